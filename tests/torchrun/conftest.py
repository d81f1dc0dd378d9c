"""Fixtures for real torchrun jobs on loopback: entry points, agents, markers."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from tests.procs import LoggedAgents, read_markers, subprocess_env

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


class Job(LoggedAgents):
    """The agents of one torchrun job (each in a session of its own), their workers' markers.

    The bound of ``until`` and ``wait`` is 180 s: four workers importing
    torch and meeting over gloo took over 60 s on a two-core machine at load
    average 50.
    """

    def __init__(self, tmp_path: Path, entry_points_path: str) -> None:
        super().__init__(tmp_path, new_session=True, bound=180)
        self.out = tmp_path / "out"
        self.out.mkdir()
        self._entry_points_path = entry_points_path

    def start_agent(self, torchrun_args: list[str], **env: str) -> subprocess.Popen[Any]:
        return self.start(
            [sys.executable, "-m", "torch.distributed.run", *torchrun_args, str(WORKER)],
            torchrun_env(self._entry_points_path, RDZV_TEST_OUT=str(self.out), **env),
        )

    def markers(self, kind: str) -> list[dict[str, Any]]:
        return read_markers(self.out, f"{kind}-*")


@pytest.fixture
def job(tmp_path: Path, entry_points_path: str) -> Iterator[Job]:
    """A torchrun job whose agents are all stopped (by process group) at the end."""
    running = Job(tmp_path, entry_points_path)
    try:
        yield running
    finally:
        running.stop()
