"""Losing a node costs no restart: a 3-node gloo DDP job survives an agent's SIGKILL.

When a node dies, the survivors' DDP workers fail first (gloo: the peer
closed the connection), before its missed heartbeats get it evicted. The
agents wait for that change of the group (``--reform-grace``) and re-form
with the two survivors instead of counting a restart, so a job with
``--max-restarts 0`` finishes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.launch.procs import agents, alive, c10d_args, finish, kill_pids
from tests.procs import wait_until

# One torch job at a time under xdist: see tests/netns/test_jobs.py.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.torch,
    pytest.mark.timeout(300),
    pytest.mark.xdist_group("torch-jobs"),
]

DDP_WORKER = str(Path(__file__).with_name("ddp_worker.py"))


def _stepped(outdir: Path, world: int) -> int:
    return len(list(outdir.glob(f"stepped-{world}-*")))


def _records(outdir: Path, world: int) -> list[dict[str, Any]]:
    found = [json.loads(p.read_text()) for p in outdir.glob("env-*.json")]
    return [r for r in found if r["WORLD_SIZE"] == str(world)]


def _finish_survivors(procs: list[subprocess.Popen[str]]) -> list[tuple[int, str, str]]:
    """Each agent's exit code and output; when one hangs, what every one of them printed."""
    results: list[tuple[int, str, str]] = []
    try:
        for p in procs:
            results.append(finish(p, timeout=120))  # noqa: PERF401 - kept up to a hang
    except subprocess.TimeoutExpired:
        tails = [
            f"agent {p.pid} ({code}):\n{out[-2000:]}\n{err[-4000:]}"
            for p, (code, out, err) in zip(procs, results, strict=False)
        ]
        for p in procs[len(results) :]:
            p.kill()
            out, err = p.communicate(timeout=30)
            tails.append(f"agent {p.pid} (hung):\n{out[-2000:]}\n{err[-4000:]}")
        raise AssertionError("a survivor did not finish:\n" + "\n".join(tails)) from None
    return results


def test_a_sigkilled_agent_of_a_ddp_job_costs_no_restart(endpoint: str, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    args = [
        *c10d_args(endpoint, "2:3", "ddp-node-loss"),
        "--max-restarts=0",
        "--reform-grace=30",
        DDP_WORKER,
        str(tmp_path),
    ]
    workers: list[int] = []
    try:
        with agents() as group:
            procs = [group.start(args) for _ in range(3)]
            wait_until(lambda: _stepped(tmp_path, 3) >= 3, timeout=120, what="3 ranks training")
            workers = [int(r["pid"]) for r in _records(tmp_path, 3)]
            victim = procs[2]
            os.kill(victim.pid, signal.SIGKILL)
            wait_until(lambda: _stepped(tmp_path, 2) >= 2, timeout=120, what="2 ranks training")
            (tmp_path / "release-2").write_text("")
            results = _finish_survivors(procs[:2])
            victim.communicate(timeout=10)
        assert victim.returncode == -signal.SIGKILL
        assert [code for code, _, _ in results] == [0, 0], results
        out = "".join(o for _, o, _ in results)
        assert out.count("parameters in sync: True") == 2, out
        assert all("not counted as a restart" in err for _, _, err in results), results
        # the survivors name the node that went: its key holds its agent's pid
        assert all(f"#{victim.pid}#" in err for _, _, err in results), results
        assert {r["TORCHELASTIC_RESTART_COUNT"] for r in _records(tmp_path, 2)} == {"0"}
        victim_worker = next(
            int(r["pid"]) for r in _records(tmp_path, 3) if r["ppid"] == victim.pid
        )
        wait_until(lambda: not alive(victim_worker), timeout=20, what="the victim's worker to end")
    finally:
        kill_pids(workers)
