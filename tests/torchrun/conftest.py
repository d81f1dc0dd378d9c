"""Fixtures for real torchrun jobs on loopback: entry points, agents, markers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from tests.procs import subprocess_env

WORKER = Path(__file__).with_name("worker.py")
HANDLERS = {
    "rdzv": "rdzv.torchrun:tcp_creator",
    "rdzv-etcd": "rdzv.torchrun:etcd_creator",
    "rdzv-redis": "rdzv.torchrun:redis_creator",
}


def _installed_handlers() -> set[str]:
    return {
        ep.name
        for ep in metadata.entry_points(group="torchrun.handlers")
        if ep.value in HANDLERS.values()
    }


@pytest.fixture(scope="session")
def entry_points_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A PYTHONPATH entry that makes torch find rdzv's torchrun.handlers entry points.

    With ``pip install -e .`` (CI) the installed metadata has them and the
    entry is empty; otherwise a ``dist-info`` with only the entry points is
    written to a temporary directory.
    """
    if _installed_handlers() == set(HANDLERS):
        return ""
    root = tmp_path_factory.mktemp("entry_points")
    info = root / "rdzv_torchrun_test-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rdzv-torchrun-test\nVersion: 0\n")
    lines = "".join(f"{name} = {value}\n" for name, value in HANDLERS.items())
    (info / "entry_points.txt").write_text(f"[torchrun.handlers]\n{lines}")
    return str(root)


def torchrun_env(entry_points_path: str, **extra: str) -> dict[str, str]:
    env = subprocess_env(**extra)
    if entry_points_path:
        env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], entry_points_path])
    env.setdefault("OMP_NUM_THREADS", "1")
    env["LOGLEVEL"] = "INFO"
    return env


class Job:
    """The agents of one torchrun job, their logs and the workers' marker files."""

    def __init__(self, tmp_path: Path, entry_points_path: str) -> None:
        self.out = tmp_path / "out"
        self.out.mkdir()
        self.logs = tmp_path
        self._entry_points_path = entry_points_path
        self.agents: list[subprocess.Popen[bytes]] = []

    def start_agent(self, torchrun_args: list[str], **env: str) -> subprocess.Popen[bytes]:
        log = (self.logs / f"agent-{len(self.agents)}.log").open("wb")
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", *torchrun_args, str(WORKER)],
                env=torchrun_env(self._entry_points_path, RDZV_TEST_OUT=str(self.out), **env),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            log.close()
        self.agents.append(proc)
        return proc

    def markers(self, kind: str) -> list[dict[str, Any]]:
        found = []
        for path in self.out.glob(f"{kind}-*"):
            text = path.read_text()
            if text:
                found.append(json.loads(text))
        return found

    # The bounds only catch hangs: four workers importing torch and meeting
    # over gloo took over 60 s on a two-core machine at load average 50.
    def wait_until(self, what: str, predicate: Callable[[], bool], timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            failed = [p.args for p in self.agents if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                pytest.fail(f"{what}: not reached (failed agents: {failed})\n{self.log_tail()}")
            time.sleep(0.1)

    def wait_agents(self, timeout: float = 180) -> list[int]:
        deadline = time.monotonic() + timeout
        while any(proc.poll() is None for proc in self.agents):
            if time.monotonic() > deadline:
                pytest.fail(f"the agents did not exit within {timeout} s\n{self.log_tail()}")
            time.sleep(0.1)
        return [proc.returncode for proc in self.agents]

    def log_tail(self, lines: int = 40) -> str:
        parts = []
        for path in sorted(self.logs.glob("agent-*.log")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(parts)

    def stop(self) -> None:
        for proc in self.agents:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture
def job(tmp_path: Path, entry_points_path: str) -> Iterator[Job]:
    """A torchrun job whose agents are all stopped (by process group) at the end."""
    running = Job(tmp_path, entry_points_path)
    try:
        yield running
    finally:
        running.stop()
