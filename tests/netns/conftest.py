"""Fixtures for tests across network namespaces (skipped where none can be made)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rdzv.testing.netns import PREFIX, Host, NetnsBed, NetnsUnavailable, bed_names
from tests.netns import probe
from tests.torchrun.conftest import entry_points_path

PROBE = str(Path(__file__).with_name("probe.py"))
PROBE_PORT = 7311

__all__ = ["entry_points_path"]  # the torchrun fixture, for torchrun jobs across hosts


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind() -> Iterator[None]:
    """After the last test here: no namespace, veth or bridge of this process remains."""
    yield
    if os.geteuid() == 0:
        mine = f"{PREFIX}{os.getpid()}"
        assert bed_names(mine) == [], f"left behind by this test run: {bed_names(mine)}"


def open_bed(count: int) -> NetnsBed:
    """Enter a bed of ``count`` hosts, or skip the test with the reason."""
    bed = NetnsBed(count)
    try:
        bed.__enter__()
    except NetnsUnavailable as exc:
        pytest.skip(f"network namespaces unavailable: {exc}")
    return bed


@pytest.fixture
def bed3() -> Iterator[NetnsBed]:
    """A bed of three hosts, closed after the test."""
    bed = open_bed(3)
    try:
        yield bed
    finally:
        bed.close()


class ProbedBed:
    """A bed whose every host runs the probe server."""

    def __init__(self, bed: NetnsBed) -> None:
        self.bed = bed
        self.servers: list[subprocess.Popen[str]] = []
        for host in bed.hosts:
            proc = host.popen([sys.executable, PROBE, "serve", str(PROBE_PORT)])
            self.servers.append(proc)
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "ready"

    def reachable(self, source: Host, targets: list[str], timeout: float = 1.0) -> dict[str, bool]:
        """Try a TCP connect from ``source`` to each ``addr`` (probe port), from inside it."""
        wanted = [f"[{t}]:{PROBE_PORT}" if ":" in t else f"{t}:{PROBE_PORT}" for t in targets]
        found = source.call(probe.attempt_all, wanted, timeout)
        return {t: found[w] for t, w in zip(targets, wanted, strict=True)}

    def connected_pairs(self, ipv6: bool = False) -> set[tuple[int, int]]:
        """Return the ordered pairs (a, b), a != b, where a can connect to b (all tried at once)."""
        hosts = self.bed.hosts

        def from_host(a: Host) -> set[tuple[int, int]]:
            peers = [b for b in hosts if b is not a]
            found = self.reachable(a, [b.ipv6 if ipv6 else b.ipv4 for b in peers])
            return {(a.index, b.index) for b in peers if found[b.ipv6 if ipv6 else b.ipv4]}

        with ThreadPoolExecutor(len(hosts)) as pool:
            return set().union(*pool.map(from_host, hosts))

    def stop(self) -> None:
        for proc in self.servers:
            proc.kill()
            proc.communicate(timeout=10)


def all_pairs(count: int) -> set[tuple[int, int]]:
    return {(a, b) for a in range(count) for b in range(count) if a != b}


@pytest.fixture(scope="module")
def probed4() -> Iterator[ProbedBed]:
    bed = open_bed(4)
    try:
        probed = ProbedBed(bed)
        try:
            yield probed
        finally:
            probed.stop()
    finally:
        bed.close()
