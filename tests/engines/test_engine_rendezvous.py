"""Multi-process rendezvous on etcd and Redis: formation, late joiners, SIGKILL recovery, close.

Each test starts real agent processes (``tests.nodes.agent dynamic``) that
use ``rdzv.create_handler`` with the ``etcd`` / ``redis`` backend against a
private server.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.engines.servers import etcd_cluster, kill_process
from tests.procs import Children, subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


class Agents(Children):
    """Agent processes; ``line`` returns the next completed round or how one ended."""

    def __init__(self, backend: str, endpoint: str, run_id: str) -> None:
        super().__init__()
        self.backend, self.endpoint, self.run_id = backend, endpoint, run_id

    def start(
        self,
        min_nodes: int,
        max_nodes: int,
        rounds: int,
        close: bool = False,
        last_call: float = 0.5,
    ) -> subprocess.Popen[str]:
        args = [
            sys.executable,
            "-m",
            "tests.nodes.agent",
            "dynamic",
            *("--backend", self.backend, "--endpoint", self.endpoint, "--run-id", self.run_id),
            *("--min", str(min_nodes), "--max", str(max_nodes), "--rounds", str(rounds)),
            *("--join", "60", "--close-timeout", "10", "--last-call", str(last_call)),
        ]
        if close:
            args.append("--close")
        return self.popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env()
        )

    @staticmethod
    def line(proc: subprocess.Popen[str]) -> dict[str, Any]:
        """Return the agent's next ``round`` or ``exit`` line."""
        assert proc.stdout is not None
        while text := proc.stdout.readline():
            result: dict[str, Any] = json.loads(text)
            if result["event"] in ("round", "exit"):
                return result
        _, err = proc.communicate(timeout=30)
        raise AssertionError(
            f"agent {proc.pid} exited ({proc.returncode}) without a line: {err[-3000:]}"
        )

    @staticmethod
    def finish(proc: subprocess.Popen[str]) -> None:
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-3000:]


@pytest.fixture(
    params=[
        pytest.param("etcd", marks=pytest.mark.etcd),
        pytest.param("redis", marks=pytest.mark.redis),
    ]
)
def agents(request: pytest.FixtureRequest, unique: str) -> Iterator[Agents]:
    if request.param == "etcd":
        endpoint = request.getfixturevalue("etcd").endpoints
    else:
        endpoint = request.getfixturevalue("redis_srv").endpoint
    made = Agents(request.param, endpoint, unique)
    try:
        yield made
    finally:
        made.stop()


def check_round(results: list[dict[str, Any]], size: int) -> None:
    assert all(r["event"] == "round" for r in results), results
    assert sorted(r["rank"] for r in results) == list(range(size))
    assert {r["world_size"] for r in results} == {size}
    assert len({tuple(r["participants"]) for r in results}) == 1


def test_formation(agents: Agents) -> None:
    procs = [agents.start(3, 3, 1) for _ in range(3)]
    check_round([agents.line(p) for p in procs], 3)
    for p in procs:
        agents.finish(p)


def test_late_joiner_triggers_a_new_round(agents: Agents) -> None:
    first = [agents.start(2, 3, 2) for _ in range(2)]
    check_round([agents.line(p) for p in first], 2)
    late = agents.start(2, 3, 1)
    results = [agents.line(p) for p in [*first, late]]
    check_round(results, 3)
    for p in [*first, late]:
        agents.finish(p)


def test_sigkill_of_a_member_is_detected_and_survivors_reform(agents: Agents) -> None:
    # A last call long enough for the third agent's start on a loaded machine
    # (with 0.5 s the first two formed alone there); the survivors' round
    # below waits it out too.
    procs = [agents.start(2, 3, 2, last_call=8.0) for _ in range(3)]
    check_round([agents.line(p) for p in procs], 3)
    victim, survivors = procs[0], procs[1:]
    kill_process(victim)
    results = [agents.line(p) for p in survivors]
    check_round(results, 2)
    for p in survivors:
        agents.finish(p)


def test_close_ends_the_run_for_later_joiners(agents: Agents) -> None:
    procs = [agents.start(2, 2, 1, close=True) for _ in range(2)]
    check_round([agents.line(p) for p in procs], 2)
    for p in procs:
        agents.finish(p)
    late = agents.start(2, 2, 1)
    result = agents.line(late)
    assert result["event"] == "exit"
    assert result["error"] in ("RendezvousClosedError", "RendezvousGracefulExitError")
    agents.finish(late)


@pytest.mark.etcd
@pytest.mark.timeout(150)
def test_rendezvous_survives_the_etcd_leader_dying(unique: str) -> None:
    with etcd_cluster(3) as cluster:
        run = Agents("etcd", cluster.endpoints, unique)
        try:
            first = [run.start(3, 4, 2) for _ in range(3)]
            check_round([run.line(p) for p in first], 3)
            leader = cluster.leader()
            assert leader.proc is not None
            kill_process(leader.proc)
            late = run.start(3, 4, 1)
            results = [run.line(p) for p in [*first, late]]
            check_round(results, 4)
            for p in [*first, late]:
                run.finish(p)
        finally:
            run.stop()
