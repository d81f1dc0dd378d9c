"""Hung workers under the agent and ``rdzv run``: real workers stuck for real.

Each test's workers hang on their first attempt and give up after 60 s
(exit 99), so a watchdog or timer server that does not work fails the test
(no hang line, no stacks, the timing bound missed) instead of hanging it.
"""

from __future__ import annotations

import io
import re
import shutil
import time
from pathlib import Path

import pytest

from rdzv.launch import AgentConfig, ElasticAgent, OutputSink
from rdzv.launch.config import EXIT_OK, EXIT_WORKER_FAILED
from rdzv.launch.timers import ENABLE_VARIABLE
from tests.launch.fakes import FakeGroup, ServerFactory
from tests.launch.procs import agents, finish
from tests.procs import subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

HANG_WORKER = str(Path(__file__).with_name("hang_worker.py"))

STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\.(\d{3}) rdzv run: (.*)$")


def agent(
    outdir: Path, mode: list[str], hang_timeout: float, log_dir: Path | None, max_restarts: int
) -> tuple[ElasticAgent, list[str]]:
    messages: list[str] = []
    config = AgentConfig(
        entrypoint=[HANG_WORKER, str(outdir), *mode],
        nproc_per_node=3,
        max_restarts=max_restarts,
        monitor_interval=0.05,
        log_dir=log_dir,
        local_addr="127.0.0.1",
        stop_grace=5.0,
        env=subprocess_env(),
        hang_timeout=hang_timeout,
    )
    sink = OutputSink(io.BytesIO(), io.BytesIO())
    made = ElasticAgent(
        FakeGroup().handler(0), config, ServerFactory(), sink=sink, log=messages.append
    )
    return made, messages


def test_a_hung_group_is_restarted_with_every_workers_stacks_in_the_log_dir(
    tmp_path: Path,
) -> None:
    logs = tmp_path / "logs"
    made, messages = agent(tmp_path, ["progress", "5"], 1.0, logs, max_restarts=1)
    result = made.run()
    assert result.exit_code == EXIT_OK, (result.reason, messages)
    assert result.restarts == 1
    hung = [m for m in messages if " hung (no progress for 1 s); stacks in " in m]
    assert len(hung) == 1, messages
    assert hung[0].endswith("restarting the group (restart 1/1)")
    attempt = logs / "fake-run" / "attempt_0"
    named = re.search(r"stacks in (\S+rank_(\d)\.stacks)", hung[0])
    assert named is not None
    assert Path(named[1]).parent == attempt
    for rank, function in enumerate(["stuck_in_sleep", "stuck_on_lock", "stuck_in_c"]):
        text = (attempt / f"rank_{rank}.stacks").read_text()
        assert f"in {function}" in text, text
        assert "in progress_mode" in text
    assert sorted(p.name for p in tmp_path.glob("done-*")) == ["done-0", "done-1", "done-2"]


def test_with_no_restart_left_a_hang_fails_the_run_naming_it(tmp_path: Path) -> None:
    made, _ = agent(tmp_path, ["progress", "2"], 1.0, None, max_restarts=0)
    result = made.run()
    assert result.exit_code == EXIT_WORKER_FAILED
    assert result.failure is not None
    assert result.failure.hang is not None
    assert re.search(r"failed \(no restarts\): rank \d hung \(no progress for 1 s\)", result.reason)
    stacks = Path(result.reason.split("stacks in ")[1].split(" ")[0])
    kept = stacks.parents[2]
    try:
        assert "Fatal Python error: Aborted" in stacks.read_text()
        # Kept after the agent ended (it had no log directory).
        assert kept.name.startswith("rdzv-stacks-")
    finally:
        shutil.rmtree(kept)


def test_workers_that_never_call_progress_are_left_alone(tmp_path: Path) -> None:
    made, messages = agent(tmp_path, ["quiet", "2.5"], 0.5, None, max_restarts=1)
    result = made.run()
    assert result.exit_code == EXIT_OK, messages
    assert result.restarts == 0
    assert not [m for m in messages if "hung" in m]


def agent_times(err: str) -> list[tuple[float, str]]:
    """The agent's own lines of ``rdzv run``'s stderr: (seconds since the epoch, message)."""
    found = []
    for line in err.splitlines():
        match = STAMP.match(line)
        if match:
            when = time.mktime(time.strptime(match[1], "%Y-%m-%d %H:%M:%S")) + int(match[2]) / 1000
            found.append((when, match[3]))
    return found


def test_rdzv_run_hang_timeout_restarts_within_the_timeout_and_five_seconds(
    tmp_path: Path,
) -> None:
    timeout = 2.0
    logs = tmp_path / "logs"
    args = [
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
        f"--hang-timeout={timeout:g}",
        f"--log-dir={logs}",
    ]
    with agents() as group:
        code, _, err = finish(group.start([*args, HANG_WORKER, str(tmp_path), "progress", "5"]))
    assert code == 0, err
    lines = agent_times(err)
    hung = [(t, m) for t, m in lines if " hung (no progress for 2 s); stacks in " in m]
    assert len(hung) == 1, err
    rank = int(hung[0][1].split()[1])
    restarted = [t for t, m in lines if "starting workers" in m and "(restart 1/1" in m]
    assert len(restarted) == 1, err
    last_progress = float((tmp_path / f"last-{rank}").read_text())
    # The fault is the hung rank's last progress call; its group's new workers start
    # within S + 5 s of it (the promise), and not before S (no early verdict).
    assert timeout - 0.01 <= restarted[0] - last_progress <= timeout + 5.0, (last_progress, err)
    assert "[rank 0]: Fatal Python error: Aborted" in err


@pytest.mark.torch
def test_torchs_expiration_timer_under_rdzv_run_restarts_the_group(tmp_path: Path) -> None:
    env = subprocess_env(**{ENABLE_VARIABLE: "1"})
    args = ["--standalone", "--nproc-per-node=2", "--max-restarts=1"]
    with agents() as group:
        proc = group.start([*args, HANG_WORKER, str(tmp_path), "timer", "1"], env=env)
        code, _, err = finish(proc, timeout=110)
    assert code == 0, err
    lines = agent_times(err)
    hung = [
        (t, m) for t, m in lines if m.startswith("rank 1 hung: expiration timer 'step' expired")
    ]
    assert len(hung) == 1, err
    # The agent knows the expiration time, not the duration: the duration it
    # reports is from when it read the request, so it is 1 s less the read's
    # delay (0.999 s beside a second suite), shown to two digits.
    after = re.search(r"expired after ([0-9.]+) s;", hung[0][1])
    assert after is not None, hung[0][1]
    assert 0.5 <= float(after.group(1)) <= 1.0, hung[0][1]
    assert hung[0][1].endswith("restarting the group (restart 1/1)")
    assert "rank 1's expiration timer 'step' expired: sent SIGKILL to pid" in err
    assert "'quick'" not in err  # released timers never fire
    entered = float((tmp_path / "entered").read_text())
    assert 1.0 <= hung[0][0] - entered <= 30.0, err
    assert sorted(p.name for p in tmp_path.glob("done-*")) == ["done-0", "done-1"]
