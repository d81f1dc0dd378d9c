"""A spare takes a lost node's slot: a 4-node job with ``--keep-ranks`` and one spare.

Five ``rdzv run`` agents (local processes, each its own node key) join a
run of exactly 4 nodes: one waits as a spare. The agent of group rank 1 is
SIGKILLed; the survivors re-form with the spare, which takes group rank 1,
and the three survivors keep their group ranks (without ``--keep-ranks``
the ranks above the gap would move down and the spare would come last).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.launch.procs import WORKER, agents, c10d_args, kill_pids
from tests.procs import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _records(outdir: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in outdir.glob("env-*.json")]


def _parent(pid: int) -> int | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("PPid:"))


def _ranks_by_agent(records: list[dict[str, Any]]) -> dict[int, int]:
    """Map each agent's pid to the group rank of its (live) worker."""
    found = {}
    for r in records:
        agent = _parent(int(r["pid"]))
        if agent is not None:
            found[agent] = int(r["GROUP_RANK"])
    return found


def test_the_spare_takes_the_dead_nodes_rank_and_survivors_keep_theirs(
    endpoint: str, tmp_path: Path
) -> None:
    args = [
        *c10d_args(endpoint, "4:4", "spare-slot"),
        "--keep-ranks",
        "--max-restarts=3",
        WORKER,
        str(tmp_path),
        "sleep",
    ]
    workers: list[int] = []
    with agents() as group:
        procs = [group.start(args) for _ in range(5)]
        try:
            wait_until(lambda: len(_records(tmp_path)) >= 4, timeout=120, what="4 workers")
            first = _records(tmp_path)
            workers = [int(r["pid"]) for r in first]
            wait_until(
                lambda: len(_ranks_by_agent(first)) == 4, timeout=30, what="the workers' agents"
            )
            before = _ranks_by_agent(first)
            assert sorted(before.values()) == [0, 1, 2, 3]
            (spare,) = [p.pid for p in procs if p.pid not in before]
            victim = next(pid for pid, rank in before.items() if rank == 1)
            os.kill(victim, signal.SIGKILL)

            def second() -> list[dict[str, Any]]:
                return [r for r in _records(tmp_path) if int(r["pid"]) not in workers]

            wait_until(lambda: len(second()) >= 4, timeout=120, what="the re-formed round")
            later = second()
            workers += [int(r["pid"]) for r in later]
            wait_until(
                lambda: len(_ranks_by_agent(later)) == 4, timeout=30, what="the new workers' agents"
            )
            after = _ranks_by_agent(later)
        finally:
            kill_pids(workers)
    assert after[spare] == 1, (before, after, spare)
    for agent, rank in before.items():
        if agent != victim:
            assert after[agent] == rank, (before, after)
    assert {r["WORLD_SIZE"] for r in later} == {"4"}
