"""Real ``rdzv run`` agents: a worker is killed, and every agent names that first failure.

Two agents of one node-pair run on a ``rdzv serve`` store; worker rank 1 kills
itself with SIGKILL and the other worker exits 1 two seconds later, as a
collective that lost its peer would (``worker.py kill-peer``).
"""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest

from tests.launch.procs import WORKER, agents, c10d_args, finish
from tests.launch.test_status import status

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

KILLED = "was killed by signal SIGKILL (9)"


# How the agents describe the first failure, up to its time.
FIRST = (
    f"worker rank 1 on {socket.gethostname()} (node 1, local rank 0) was killed by signal "
    "SIGKILL at "
)


def _two_agents(
    endpoint: str, run_id: str, tmp_path: Path, mode: str, *extra: str
) -> list[tuple[int, str]]:
    args = [
        *c10d_args(endpoint, "2", run_id),
        "--nproc-per-node=1",
        *extra,
        WORKER,
        str(tmp_path),
        mode,
        "1",
        "9",
    ]
    with agents() as group:
        procs = [group.start(args, stderr_path=tmp_path / f"agent{i}.err") for i in range(2)]
        codes = [finish(p, timeout=100)[0] for p in procs]
    return [(code, (tmp_path / f"agent{i}.err").read_text()) for i, code in enumerate(codes)]


def test_a_restart_names_the_first_failure_on_every_agent_and_status_shows_it(
    endpoint: str, tmp_path: Path
) -> None:
    logs = tmp_path / "logs"
    ran = _two_agents(
        endpoint, "ff-restart", tmp_path, "kill-peer-once", "--max-restarts=1", f"--log-dir={logs}"
    )
    assert [code for code, _ in ran] == [0, 0], ran
    # The agent whose worker was killed recorded it: its own line names it.
    killed = [
        err
        for _, err in ran
        if any(
            KILLED in line and line.endswith("; restarting the group (restart 1/1)")
            for line in err.splitlines()
        )
    ]
    assert len(killed) == 1, ran
    other = next(err for _, err in ran if err is not killed[0])
    first = FIRST
    assert "after the first failure" not in killed[0]
    # The other agent's line about the re-form (or its own worker's exit and
    # restart) ends naming that first failure, with its round and log.
    named = [line for line in other.splitlines() if f"after the first failure: {first}" in line]
    assert len(named) == 1, other
    match = re.search(r"\(round (\d+), restart 0\); log: (\S+)$", named[0])
    assert match is not None, named[0]
    failed_round, log = int(match.group(1)), Path(match.group(2))
    assert log == logs / "ff-restart" / log.parent.name / "rank_1.log"
    assert "line 0 from rank 1" in log.read_text()
    # After the run, rdzv status still shows it: it outlived its round.
    done = status(endpoint, "ff-restart", "--sample=0")
    assert done.returncode == 0, done.stderr
    shown = done.stdout.splitlines()
    assert shown[-1].startswith(f"first failure: {first}"), shown
    assert shown[-1].endswith(f"(round {failed_round}, restart 0); log: {log}")
    data = json.loads(status(endpoint, "ff-restart", "--json", "--sample=0").stdout)
    assert data["round"] > failed_round
    recorded = data["first_failure"]
    assert (recorded["kind"], recorded["signal"], recorded["rank"]) == ("signal", "SIGKILL", 1)
    assert recorded["round"] == failed_round


def test_the_last_line_of_every_agent_names_the_first_failure(
    endpoint: str, tmp_path: Path
) -> None:
    ran = _two_agents(endpoint, "ff-fail", tmp_path, "kill-peer", "--max-restarts=0")
    assert [code for code, _ in ran] == [1, 1], ran
    last = [err.strip().splitlines()[-1] for _, err in ran]
    killed = [line for line in last if KILLED in line]
    assert len(killed) == 1, last
    assert "run 'ff-fail' failed (no restarts): worker rank 1 " in killed[0]
    assert "after the first failure" not in killed[0]
    other = next(line for line in last if line is not killed[0])
    assert "run 'ff-fail' failed (no restarts): worker rank 0 " in other
    assert f"exited with code 1 after the first failure: {FIRST}" in other
