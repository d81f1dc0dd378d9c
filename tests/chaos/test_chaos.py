"""The chaos harness in CI: its checker and proxy, then one short chaos run."""

from __future__ import annotations

import os
import random
import time
from typing import Any

import pytest

from rdzv.errors import RendezvousConnectionError
from rdzv.store.server import TCPStoreServer
from rdzv.store.tcp import TCPStore
from tests.chaos.harness import ChaosRun, Checker, Figures, Settings
from tests.chaos.proxy import FaultProxy


def line(node: str, rank: int, participants: list[str], **extra: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "event": "round",
        "node": node,
        "round": 3,
        "rank": rank,
        "world_size": len(participants),
        "participants": participants,
        "epoch": 1,
        "at": 1000.0,
        "took": 1.0,
    }
    fields.update(extra)
    return fields


@pytest.fixture
def checker() -> Checker:
    return Checker(Settings(seed=0), Figures(seed=0))


def test_summary_names_the_first_message_of_each_error() -> None:
    figures = Figures(seed=0)
    figures.agent_errors["RendezvousConnectionError"] += 2
    figures.error_samples["rendezvous RendezvousConnectionError"] = "could not connect within 3 s"
    assert "first rendezvous RendezvousConnectionError: could not connect within 3 s" in (
        figures.summary()
    )


def test_checker_accepts_an_agreeing_round(checker: Checker) -> None:
    checker.round_line(line("a", 0, ["a", "b"]))
    checker.round_line(line("b", 1, ["a", "b"]))
    checker.finish()
    assert checker.figures.violations == []
    assert checker.figures.rounds == 1


def test_checker_flags_two_groups_completing_one_round(checker: Checker) -> None:
    checker.round_line(line("a", 0, ["a", "b"]))
    checker.round_line(line("c", 0, ["c", "d"]))
    assert any("two groups" in v for v in checker.figures.violations)


def test_checker_flags_a_rank_that_disagrees_with_the_participants(checker: Checker) -> None:
    checker.round_line(line("b", 0, ["a", "b"]))
    assert any("does not match" in v for v in checker.figures.violations)


def test_checker_flags_a_dead_node_past_the_detection_bound(checker: Checker) -> None:
    bound = checker.settings.detection_bound
    checker.node_killed("b", 1000.0 - bound - 1.0)
    checker.round_line(line("a", 0, ["a", "b"]))
    checker.finish()
    assert any("was killed" in v for v in checker.figures.violations)


def test_checker_allows_a_dead_node_within_the_bound(checker: Checker) -> None:
    checker.node_killed("b", 1000.0 - 0.5)
    checker.round_line(line("a", 0, ["a", "b"]))
    checker.finish()
    assert checker.figures.violations == []


def test_checker_flags_a_call_past_its_deadline_unless_paused(checker: Checker) -> None:
    deadline = checker.settings.call_deadline
    checker.node_paused("a", 10.0)
    checker.round_line(line("a", 0, ["a"], took=deadline + 5.0))
    assert checker.figures.violations == []
    checker.round_line(line("a", 0, ["a"], took=deadline + 11.0, round=4))
    assert any("next_rendezvous returned" in v for v in checker.figures.violations)


def test_checker_sets_aside_rounds_straddling_a_store_restart(checker: Checker) -> None:
    checker.round_line(line("a", 0, ["a", "b"], epoch=None))
    checker.round_line(line("c", 0, ["c", "d"]))
    assert checker.figures.violations == []
    assert checker.figures.straddled == 1


@pytest.mark.timeout(60)
def test_proxy_forwards_cuts_and_delays() -> None:
    server = TCPStoreServer("127.0.0.1", 0).start()
    proxy = FaultProxy(server.port)
    try:
        with TCPStore("127.0.0.1", proxy.port, timeout=5) as client:
            client.set("k", "v")
            # torch's SET has no reply: read it back so it is not in flight when cut.
            assert client.get("k") == b"v"
            assert proxy.cut() >= 1
            with pytest.raises(RendezvousConnectionError):
                client.get("k")
            assert client.get("k") == b"v"  # the next call reconnects
            proxy.delay = 0.2
            started = time.monotonic()
            assert client.get("k") == b"v"
            assert time.monotonic() - started >= 0.2  # lower bound only: the delay applied
    finally:
        proxy.close()
        server.stop()


@pytest.mark.slow
@pytest.mark.xdist_group("chaos-runs")  # under xdist: one run at a time, handed out first
@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend", ["tcp", "etcd", "etcd3", "redis"])
def test_short_chaos_run_has_no_violations(backend: str) -> None:
    seed = int(os.environ.get("RDZV_CHAOS_SEED", random.randrange(1 << 31)))
    settings = Settings(
        seed=seed,
        backend=backend,
        agents=4,
        min_nodes=2,
        max_nodes=4,
        seconds=10.0,
        min_faults=3,
        min_rounds=2,
    )
    figures = ChaosRun(settings).run()
    report = f"replay with RDZV_CHAOS_SEED={seed}\n{figures.summary()}"
    assert figures.violations == [], report
    assert figures.rounds >= 2, report  # the run goes on (up to 60 s more) until 2 formed
    # The schedule's faults, not how many fit into 10 s of a loaded machine.
    assert sum(figures.faults.values()) >= settings.min_faults, report
    assert figures.state_reads > 0, report


def test_checker_flags_endless_re_formation_without_a_fault() -> None:
    settings = Settings(seed=0, steady=True)
    checker = Checker(settings, Figures(seed=0))
    checker.disturbed(1000.0)
    checker.round_line(line("a", 0, ["a", "b"], at=1000.5))
    checker.round_line(line("a", 0, ["a", "b"], at=1000.0 + settings.settle + 1.0, round=4))
    checker.finish(ended=1000.0 + 3 * settings.settle)
    assert any("endless re-formation" in v for v in checker.figures.violations)
    assert checker.figures.quiet_seconds == pytest.approx(2 * settings.settle)


def test_checker_does_not_count_time_the_machine_gave_no_cpu_towards_settling() -> None:
    # A loaded machine: the harness's sampler overslept 2 s after the fault,
    # so a round 1 s past the settle time is the fault's, not an endless one.
    settings = Settings(seed=0, steady=True)
    checker = Checker(settings, Figures(seed=0))
    checker.disturbed(1000.0)
    checker.harness_starved(1001.0, 1003.0)
    checker.round_line(line("a", 0, ["a", "b"], at=1000.0 + settings.settle + 1.0, round=4))
    checker.finish(ended=1000.0 + 3 * settings.settle)
    assert checker.figures.violations == []
    # Starvation is credited only for the time it lasted.
    checker.round_line(line("a", 0, ["a", "b"], at=1000.0 + settings.settle + 3.0, round=5))
    checker.finish(ended=1000.0 + 3 * settings.settle)
    assert any("endless re-formation" in v for v in checker.figures.violations)


def test_checker_accepts_rounds_that_follow_a_disturbance() -> None:
    settings = Settings(seed=0, steady=True)
    checker = Checker(settings, Figures(seed=0))
    checker.disturbed(1000.0)
    checker.disturbed(1030.0)
    checker.round_line(line("a", 0, ["a", "b"], at=1001.0))
    checker.round_line(line("a", 0, ["a", "b"], at=1031.0, round=4))
    checker.finish(ended=1060.0)
    assert checker.figures.violations == []


def test_checker_extends_the_detection_bound_by_a_store_pause(checker: Checker) -> None:
    bound = checker.settings.detection_bound
    checker.node_killed("b", 1000.0 - bound - 1.0)
    checker.store_stalled(1000.0 - bound, 1000.0 - bound + 2.0)
    checker.round_line(line("a", 0, ["a", "b"]))
    checker.finish()
    assert checker.figures.violations == []


@pytest.mark.slow
@pytest.mark.xdist_group("chaos-runs")  # under xdist: one run at a time, handed out first
@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend", ["tcp", "redis"])
def test_short_chaos_run_meets_each_new_fault_and_stays_flat_when_quiet(backend: str) -> None:
    seed = int(os.environ.get("RDZV_CHAOS_SEED", random.randrange(1 << 31)))
    kinds = ("kill-cut", "store-pause", "poison")
    settings = Settings(
        seed=seed,
        backend=backend,
        agents=3,
        min_nodes=2,
        max_nodes=4,
        seconds=8.0,
        min_faults=len(kinds),
        steady=True,
        kinds=kinds,
        store_restarts=False,
    )
    settings.quiet_tail = settings.settle + 6.0
    figures = ChaosRun(settings).run()
    report = f"replay with RDZV_CHAOS_SEED={seed}\n{figures.summary()}"
    assert figures.violations == [], report
    # The seeded schedule's faults, each met once, not how many fit into the time.
    assert all(figures.faults[kind] >= 1 for kind in kinds), report
    assert figures.quiet_seconds > 0, report
