"""The chaos harness across network namespaces in CI: short runs with partition faults."""

from __future__ import annotations

import os
import random
import time

import pytest

from rdzv.testing.netns import NetnsUnavailable, bed_names
from tests.chaos.harness import ChaosRun, Settings
from tests.chaos.netns import FAULTS, NetnsTopology


@pytest.mark.slow
@pytest.mark.xdist_group("chaos-runs")  # under xdist: one run at a time, handed out first
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "backend",
    [
        "tcp",
        pytest.param("etcd3", marks=pytest.mark.etcd),
        pytest.param("redis", marks=pytest.mark.redis),
    ],
)
def test_short_netns_chaos_run_has_no_violations(backend: str) -> None:
    seed = int(os.environ.get("RDZV_CHAOS_SEED", random.randrange(1 << 31)))
    settings = Settings(
        seed=seed,
        backend=backend,
        agents=4,
        min_nodes=2,
        max_nodes=4,
        seconds=10.0,
        min_faults=4,
        min_rounds=2,
        net="netns",
    )
    try:
        run = ChaosRun(settings)
    except NetnsUnavailable as exc:
        pytest.skip(f"network namespaces unavailable: {exc}")
    assert run.topology is not None
    tag = run.topology.bed.tag
    figures = run.run()
    report = f"replay with RDZV_CHAOS_SEED={seed}\n{figures.summary()}"
    assert figures.violations == [], report
    assert figures.rounds >= 2, report  # 2 within 70 s, however loaded the machine
    assert sum(figures.faults.values()) >= settings.min_faults, report
    assert figures.state_reads > 0, report
    assert bed_names(tag) == []


@pytest.mark.timeout(60)
def test_partition_faults_cut_the_bed_and_heal_when_due() -> None:
    try:
        topology = NetnsTopology("tcp", 4)
    except NetnsUnavailable as exc:
        pytest.skip(f"network namespaces unavailable: {exc}")
    try:
        bed = topology.bed
        rng = random.Random(7)
        assert set(FAULTS) == {"split", "isolate-leader"}
        topology.inject("split", rng)
        cut = bed.cut_pairs()
        assert cut
        sides = {a for a, _ in cut} | {b for _, b in cut}
        assert sides == set(range(5))  # a split into two groups cuts every host from some
        topology.inject("isolate-leader", rng)  # the store host (0) and at most 1 of 4 agents
        cut = bed.cut_pairs()
        group = {0} | {h for h in range(1, 5) if (0, h) not in cut}
        assert len(group) <= 2
        assert cut == {(min(a, b), max(a, b)) for a in group for b in set(range(5)) - group}
        topology._heal_at = time.monotonic() + 3600
        assert not topology.tick()
        assert bed.cut_pairs() == cut
        topology._heal_at = time.monotonic() - 1
        assert topology.tick()
        assert bed.cut_pairs() == set()
        assert not topology.tick()
    finally:
        topology.close()
    assert bed_names(bed.tag) == []
