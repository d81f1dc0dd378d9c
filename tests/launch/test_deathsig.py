"""Workers ask for the parent-death signal with no Python between fork and exec."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rdzv.launch import deathsig
from rdzv.launch.workers import OutputSink, WorkerGroup, WorkerSpec, start_process
from tests.engines.servers import EtcdCluster
from tests.procs import subprocess_env, wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG")

_PROBE = """
import ctypes, json, os
value = ctypes.c_int()
ctypes.CDLL(None).prctl(2, ctypes.byref(value))
print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "signal": value.value,
                  "sid": os.getsid(0), "marker": os.environ.get("RDZV_MARKER")}))
"""


def _trampoline(kind: str, parent: int) -> tuple[str, ...]:
    if kind == "setpriv":
        setpriv = deathsig._setpriv()
        assert setpriv is not None, "no setpriv with --pdeathsig (util-linux 2.33+)"
        return deathsig.trampoline_of(setpriv, None, parent)
    return deathsig.trampoline_of(None, sys.executable, parent)


@pytest.mark.parametrize("kind", ["setpriv", "python"])
def test_each_trampoline_asks_for_sigkill_and_execs_the_worker_in_its_own_process(
    kind: str,
) -> None:
    env = {**os.environ, "RDZV_MARKER": "through"}
    process = subprocess.Popen(
        [*_trampoline(kind, os.getpid()), sys.executable, "-c", _PROBE],
        env=env,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    out, _ = process.communicate(timeout=60)
    assert process.returncode == 0
    seen = json.loads(out)
    assert seen == {
        "pid": process.pid,
        "ppid": os.getpid(),
        "signal": signal.SIGKILL,
        "sid": process.pid,
        "marker": "through",
    }


def test_the_python_trampoline_whose_parent_is_gone_does_not_start_the_worker(
    tmp_path: Path,
) -> None:
    """The agent died before the signal was asked for: no orphan worker."""
    marker = tmp_path / "ran"
    not_the_parent = os.getppid()
    process = subprocess.Popen(
        [*_trampoline("python", not_the_parent), "touch", str(marker)], start_new_session=True
    )
    assert process.wait(timeout=60) == 1
    assert not marker.exists()


def test_a_started_worker_is_armed_when_start_process_returns() -> None:
    """setpriv asked for the signal and exec'd the worker before the agent goes on.

    Otherwise an agent killed at once after starting it leaves an orphan.
    """
    sleeper = os.path.realpath(shutil.which("sleep") or "/bin/sleep")
    for _ in range(20):
        process = start_process([sleeper, "30"], os.environ)
        try:
            assert os.readlink(f"/proc/{process.pid}/exe") == sleeper
        finally:
            process.kill()
            process.communicate(timeout=30)


def test_the_default_trampoline_is_setpriv_here() -> None:
    assert deathsig.trampoline() == (deathsig._programs()[0], "--pdeathsig", "KILL", "--")


def test_a_started_worker_asks_for_sigkill() -> None:
    process = start_process([sys.executable, "-c", _PROBE], os.environ)
    out, _ = process.communicate(timeout=60)
    assert json.loads(out)["signal"] == signal.SIGKILL


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def test_a_worker_dies_with_the_agent_that_started_it() -> None:
    agent_code = (
        "import os, sys, time\n"
        "from rdzv.launch.workers import start_process\n"
        "worker = start_process([sys.executable, '-c', 'import time; time.sleep(120)'], os.environ)\n"
        "print(worker.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    agent = subprocess.Popen(
        [sys.executable, "-c", agent_code], env=subprocess_env(), stdout=subprocess.PIPE, text=True
    )
    worker = 0
    try:
        assert agent.stdout is not None
        worker = int(agent.stdout.readline())
        assert not _gone(worker)
        agent.kill()
        agent.wait(timeout=30)
        wait_until(lambda: _gone(worker), "the worker to die with its agent", timeout=30)
    finally:
        if agent.poll() is None:
            agent.kill()
        agent.communicate(timeout=30)
        if worker and not _gone(worker):
            os.kill(worker, signal.SIGKILL)


def test_a_missing_or_unrunnable_program_is_an_oserror_when_started(tmp_path: Path) -> None:
    program = tmp_path / "prog"
    program.write_text("#!/bin/sh\necho ran\n")
    env = {"PATH": str(tmp_path)}
    with pytest.raises(FileNotFoundError, match="no-such-program"):
        start_process(["no-such-program"], env)
    with pytest.raises(PermissionError, match="prog"):
        start_process(["prog"], env)
    program.chmod(0o755)
    # Looked up in the worker's PATH, as subprocess does.
    process = start_process(["prog"], env)
    assert process.communicate(timeout=60) == (b"ran\n", b"")
    with pytest.raises(FileNotFoundError):
        start_process([str(tmp_path / "missing")], env)
    sink = OutputSink(io.BytesIO(), io.BytesIO())
    group = WorkerGroup([WorkerSpec(0, 0, ["no-such-program"], env)], sink)
    with pytest.raises(OSError, match="no-such-program"):
        group.start()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_busy_grpc_client_in_the_agent_no_longer_aborts_started_workers(
    etcd: EtcdCluster,
) -> None:
    # grpcio aborted 10 and 8 of 300 children started with a preexec_fn beside this
    # load (grpc/grpc#43055; `python tests/launch/grpc_spawner.py ENDPOINT 300
    # --preexec`): none may die now, with grpcio's fork handlers on.
    env = subprocess_env(GRPC_VERBOSITY="ERROR")
    env.pop("GRPC_ENABLE_FORK_SUPPORT", None)
    spawner = str(Path(__file__).with_name("grpc_spawner.py"))
    result = subprocess.run(
        [sys.executable, spawner, etcd.endpoint, "300"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["calls"] > 0
    assert report["failed"] == [], report
