"""Real processes rendezvousing through a real TCP store on loopback."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.integration.conftest import Agent
from tests.procs import free_port, subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

CLIENT = ("--is-host", "false")


def _same_round(rounds: list[dict[str, Any]]) -> None:
    assert sorted(r["rank"] for r in rounds) == list(range(len(rounds)))
    assert {r["world_size"] for r in rounds} == {len(rounds)}
    assert len({tuple(r["participants"]) for r in rounds}) == 1
    assert len({tuple(r["master"]) for r in rounds}) == 1


def _round(agent: Agent, world_size: int, timeout: float = 30) -> dict[str, Any]:
    return agent.wait_for(
        lambda i: i["event"] == "round" and i["world_size"] == world_size, timeout
    )


def test_formation_and_max_completes_at_once(
    agents: Callable[..., Agent], store_endpoint: str
) -> None:
    # last call of 60 s: only reaching max_nodes can complete the round in time.
    common = (
        "--endpoint",
        store_endpoint,
        "--min",
        "2",
        "--max",
        "3",
        "--last-call",
        "60",
        *CLIENT,
    )
    nodes = [agents(*common, "--addr", f"127.0.0.{i}") for i in (1, 2, 3)]
    _same_round([_round(a, 3) for a in nodes])
    for a in nodes:
        assert a.finish()["error"] is None


def test_last_call_admits_a_straggler(agents: Callable[..., Agent], store_endpoint: str) -> None:
    common = ("--endpoint", store_endpoint, "--min", "2", "--max", "4", "--last-call", "2", *CLIENT)
    third = agents(*common, "--wait-go")  # started early: its start-up is not timed
    third.wait_for(lambda i: i["event"] == "ready")
    first = [agents(*common), agents(*common)]
    for agent in first:
        agent.wait_for(lambda i: i.get("action") == "enqueue")
    third.go()  # arrives after min_nodes joined, within the last call
    _same_round([_round(a, 3) for a in [*first, third]])


def test_late_joiner_waits_and_is_admitted_next_round(
    agents: Callable[..., Agent], store_endpoint: str
) -> None:
    common = (
        "--endpoint",
        store_endpoint,
        "--min",
        "2",
        "--max",
        "3",
        "--last-call",
        "0.5",
        *CLIENT,
    )
    members = [agents(*common, "--rounds", "2", "--addr", f"127.0.0.{i}") for i in (1, 2)]
    first = [_round(a, 2) for a in members]
    _same_round(first)
    late = agents(*common, "--addr", "127.0.0.9")
    for a in members:
        a.wait_for(lambda i: i["event"] == "waiting")
    second = [_round(a, 3) for a in [*members, late]]
    _same_round(second)
    assert second[0]["participants"][:2] == first[0]["participants"]


def test_sigkill_while_joining(agents: Callable[..., Agent], store_endpoint: str) -> None:
    common = (
        "--endpoint",
        store_endpoint,
        "--min",
        "2",
        "--max",
        "3",
        "--last-call",
        "1.5",
        *CLIENT,
    )
    victim = agents(*common, "--addr", "127.0.0.7")
    victim.wait_for(lambda i: i.get("action") == "enqueue")
    victim.kill()
    survivors = [agents(*common, "--rounds", "3", "--addr", f"127.0.0.{i}") for i in (1, 2)]
    # The dead node may be sealed into a round; it is then detected and the
    # survivors re-form without it.
    _same_round([_round(a, 2, timeout=40) for a in survivors])


def test_sigkill_after_completion_triggers_a_new_round(
    agents: Callable[..., Agent], store_endpoint: str
) -> None:
    common = (
        "--endpoint",
        store_endpoint,
        "--min",
        "2",
        "--max",
        "3",
        "--last-call",
        "0.5",
        *CLIENT,
    )
    # Released together, and a round to spare: on a loaded machine a round of
    # two may still form before the third node comes (the last call is 0.5 s).
    nodes = [
        agents(*common, "--rounds", "3", "--wait-go", "--addr", f"127.0.0.{i}") for i in (1, 2, 3)
    ]
    for a in nodes:
        a.go()
    of_three = [_round(a, 3) for a in nodes]
    _same_round(of_three)
    nodes[1].kill()

    def next_round_of_two(agent: Agent, after: dict[str, Any]) -> dict[str, Any]:
        def later(i: dict[str, Any]) -> bool:
            return (
                i["event"] == "round"
                and i["world_size"] == 2
                and agent.lines.index(i) > agent.lines.index(after)
            )

        return agent.wait_for(later, timeout=30)

    _same_round([next_round_of_two(nodes[i], of_three[i]) for i in (0, 2)])


def test_a_sigkilled_node_is_found_by_its_will_long_before_its_heartbeats_run_out(
    agents: Callable[..., Agent], store_endpoint: str
) -> None:
    """The kernel closes a killed node's connections and the store writes its will.

    The dead-node timeout is 1 s x 30 = 30 s; the survivors re-form within
    the 20 s this test allows only because the killed node's heartbeat
    counter says ``gone`` (judged after a 1 s grace).
    """
    common = (
        "--endpoint",
        store_endpoint,
        "--min",
        "2",
        "--max",
        "3",
        "--last-call",
        "0.5",
        "--interval",
        "1",
        "--attempts",
        "30",
        "--join",
        "120",
        *CLIENT,
    )
    nodes = [
        agents(*common, "--rounds", "2", "--wait-go", "--addr", f"127.0.0.{i}") for i in (1, 2, 3)
    ]
    for a in nodes:
        a.go()
    of_three = [_round(a, 3) for a in nodes]
    _same_round(of_three)
    time.sleep(2.5)  # past the first beat (1 s), which makes each node's will
    nodes[1].kill()
    _same_round([_round(nodes[i], 2, timeout=20) for i in (0, 2)])


def test_skewed_clocks_do_not_evict_the_living_nor_keep_the_dead(
    agents: Callable[..., Agent], store_endpoint: str
) -> None:
    common = (
        "--endpoint", store_endpoint, "--min", "2", "--max", "3", "--interval", "0.4",
        *CLIENT, "--rounds", "2",
    )  # fmt: skip
    nodes = [
        agents(*common, "--addr", "127.0.0.1", "--clock-skew", "3600"),
        agents(*common, "--addr", "127.0.0.2", "--clock-skew", "-3600"),
        agents(*common, "--addr", "127.0.0.3"),
    ]
    rounds = [_round(a, 3) for a in nodes]
    _same_round(rounds)
    time.sleep(2.5)  # > 2 dead-node timeouts (0.4 s x 3)
    for a, formed in zip(nodes, rounds, strict=True):
        # On a loaded machine one agent may start after the last call, so a
        # round of two forms first and grows: its members leave it (an
        # "evict" of themselves). Nobody is ever judged dead, and what follows
        # the round of three is quiet.
        lines = list(a.lines)
        after = lines[next(i for i, line in enumerate(lines) if line is formed) + 1 :]
        assert not any(i.get("action") == "dead" for i in lines), lines
        assert not any(i["event"] == "waiting" or i.get("action") == "evict" for i in after), lines
    nodes[0].kill()
    survivors = nodes[1:]
    _same_round([_round(a, 2) for a in survivors])


def test_join_timeout_is_exhausted(agents: Callable[..., Agent], store_endpoint: str) -> None:
    lonely = agents(
        "--endpoint", store_endpoint, "--min", "2", "--max", "2", "--join", "1", *CLIENT
    )
    result = lonely.finish()
    assert result["error"] == "RendezvousExhaustedError"
    assert lonely.proc.returncode == 3


def test_closed_run_rejects_later_joins(agents: Callable[..., Agent], store_endpoint: str) -> None:
    common = ("--endpoint", store_endpoint, "--min", "1", "--max", "1", *CLIENT)
    closer = agents(*common, "--close-after", "0", "--hold", "0.2")
    closer.wait_for(lambda i: i["event"] == "closed")
    assert closer.finish()["error"] is None
    late = agents(*common)
    assert late.finish()["error"] == "RendezvousClosedError"


def test_spare_exits_gracefully_when_the_run_closes(
    agents: Callable[..., Agent], store_endpoint: str
) -> None:
    common = ("--endpoint", store_endpoint, "--min", "2", "--max", "2", *CLIENT)
    members = [agents(*common, "--hold", "30") for _ in range(2)]
    _same_round([_round(a, 2) for a in members])
    spare = agents(*common)
    spare.wait_for(lambda i: i.get("action") == "enqueue")
    closer = agents(*common, "--rounds", "0", "--close-after", "0")
    assert closer.finish()["error"] is None
    result = spare.finish()
    assert result["error"] == "RendezvousGracefulExitError"
    assert spare.proc.returncode == 0


def test_store_host_going_away_is_a_connection_error(agents: Callable[..., Agent]) -> None:
    port = free_port()
    host = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time; from rdzv.store.tcp import TCPStore; "
                f"s = TCPStore('127.0.0.1', {port}, is_master=True, timeout=10); "
                "print('up', flush=True); time.sleep(120)"
            ),
        ],
        stdout=subprocess.PIPE,
        env=subprocess_env(),
        text=True,
    )
    try:
        assert host.stdout is not None
        assert host.stdout.readline().strip() == "up"
        waiter = agents(
            "--endpoint", f"127.0.0.1:{port}", "--min", "2", "--max", "2", "--join", "60", *CLIENT
        )
        waiter.wait_for(lambda i: i.get("action") == "enqueue")
        host.kill()
        result = waiter.finish(timeout=40)
        assert result["error"] == "RendezvousConnectionError"
    finally:
        host.kill()
        host.wait(timeout=10)
        if host.stdout is not None:
            host.stdout.close()


def test_first_local_node_hosts_the_store(agents: Callable[..., Agent]) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    common = ("--endpoint", endpoint, "--min", "2", "--max", "2", "--hold", "1")
    nodes = [agents(*common), agents(*common)]  # both infer is_host; one binds, one falls back
    _same_round([_round(a, 2) for a in nodes])
