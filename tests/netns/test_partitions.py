"""Partitions with stated outcomes: rendezvous nodes in namespaces, packets dropped between them.

Each node (:mod:`tests.nodes.agent` ``loop --retry``) re-rendezvouses for as long as it runs
and prints every round it completes and every error it gets, with how long
the call took; the test cuts the network, watches, heals, watches again and
then checks the outcome from the lines. Clocks: all nodes run on this
machine, so their ``time.time()`` stamps compare.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from rdzv.testing.netns import Host, NetnsBed
from tests.netns.conftest import open_bed
from tests.netns.engines import NetnsEtcd
from tests.procs import subprocess_env, wait_until

pytestmark = pytest.mark.slow

C10D_PORT = 29456
JOIN_TIMEOUT = 20.0
READ_TIMEOUT = 3.0
KEEP_ALIVE = 0.5
ATTEMPTS = 3
#: Longest a ``next_rendezvous`` may take: the join timeout, plus two store
#: timeouts (a read and a write in flight when the network went), plus 5 s of
#: slack for a loaded two-core machine. A hang-catching bound, not a figure.
CALL_DEADLINE = JOIN_TIMEOUT + 2 * READ_TIMEOUT + 5.0


class Nodes:
    """Node processes, one per given host, and every line they print (thread-safe)."""

    def __init__(self, bed: NetnsBed) -> None:
        self.bed = bed
        self.procs: dict[int, subprocess.Popen[str]] = {}
        self.lines: queue.Queue[tuple[int, dict[str, Any]]] = queue.Queue()
        self.seen: list[tuple[int, dict[str, Any]]] = []
        self.keys: dict[int, str] = {}
        self._threads: list[threading.Thread] = []

    def start(self, host: Host, backend: str, endpoint: str) -> None:
        """Start a node on ``host`` that rejoins after errors, for 150 s, in 2 to 5 nodes."""
        options = (
            f"loop --retry --backend {backend} --endpoint {endpoint} --addr {host.ipv4} "
            f"--run-id partitions --min 2 --max 5 --seconds 150 --join {JOIN_TIMEOUT} "
            f"--read-timeout {READ_TIMEOUT} --interval {KEEP_ALIVE} --attempts {ATTEMPTS} --hold 1"
        )
        proc = host.popen(
            [sys.executable, "-m", "tests.nodes.agent", *options.split()],
            env=subprocess_env(),
            stderr=subprocess.DEVNULL,
        )
        self.procs[host.index] = proc
        thread = threading.Thread(target=self._read, args=(host.index, proc), daemon=True)
        thread.start()
        self._threads.append(thread)

    def _read(self, index: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            self.lines.put((index, line))

    def drain(self) -> list[tuple[int, dict[str, Any]]]:
        while True:
            try:
                index, line = self.lines.get_nowait()
            except queue.Empty:
                return self.seen
            self.keys.setdefault(index, line["node"])
            self.seen.append((index, line))

    def rounds(self, since: float = 0.0) -> list[tuple[int, dict[str, Any]]]:
        return [(i, ln) for i, ln in self.drain() if ln["event"] == "round" and ln["at"] >= since]

    def wait_for(self, what: str, predicate: Callable[[], bool], timeout: float = 90) -> None:
        wait_until(predicate, what, timeout, every=0.1, detail=lambda: self.drain()[-30:])

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        for thread in self._threads:
            thread.join(30)
        for proc in self.procs.values():
            if proc.stdout is not None:
                proc.stdout.close()


def rendezvous_failed(nodes: Nodes, which: set[int], since: float) -> Callable[[], bool]:
    """Each of ``which`` had a ``next_rendezvous`` call started after ``since`` raise."""

    def found() -> bool:
        failed = {
            i
            for i, ln in nodes.drain()
            if ln["event"] == "error"
            and ln["phase"] == "rendezvous"
            and ln["at"] - ln["took"] > since
        }
        return which <= failed

    return found


def full_round(nodes: Nodes, members: set[int], since: float) -> Callable[[], bool]:
    """A round completed after ``since`` whose participants are exactly ``members``' nodes."""

    def found() -> bool:
        for _, line in nodes.rounds(since):
            keys = {nodes.keys.get(i) for i in members}
            if None not in keys and set(line["participants"]) == keys:
                return True
        return False

    return found


def check_no_two_groups_complete_one_round(nodes: Nodes) -> None:
    groups: dict[int, set[tuple[str, ...]]] = defaultdict(set)
    for _, line in nodes.rounds():
        groups[line["round"]].add(tuple(line["participants"]))
    split = {r: g for r, g in groups.items() if len(g) > 1}
    assert split == {}, f"rounds completed by two groups: {split}"


def check_calls_bounded(nodes: Nodes) -> None:
    """Every timed call (the lines with a ``took``: rounds and rendezvous errors) is bounded."""
    slow = [(i, ln) for i, ln in nodes.drain() if ln.get("took", 0.0) > CALL_DEADLINE]
    assert slow == [], f"calls past {CALL_DEADLINE} s: {slow}"


@pytest.fixture
def bed5() -> Iterator[NetnsBed]:
    bed = open_bed(5)
    try:
        yield bed
    finally:
        bed.close()


@pytest.fixture
def nodes(bed5: NetnsBed) -> Iterator[Nodes]:
    group = Nodes(bed5)
    try:
        yield group
    finally:
        group.stop()


@pytest.mark.etcd
@pytest.mark.timeout(240)
def test_etcd_leader_cut_off_with_a_minority_of_nodes(bed5: NetnsBed, nodes: Nodes) -> None:
    """Members on hosts 0-2, a node on every host; the leader's host and one more are cut off.

    The minority (the leader's host and host 3) completes no round while cut
    off and its calls end within their deadlines; the majority (two members,
    three nodes) elects a leader and re-forms; after healing all five form
    one round; no round is ever completed by two groups.
    """
    with NetnsEtcd(bed5.hosts[:3]) as etcd:
        for host in bed5.hosts:
            nodes.start(host, "etcd", etcd.endpoints)
        everyone = set(range(5))
        nodes.wait_for("a round of all five", full_round(nodes, everyone, 0.0))
        leader = etcd.leader().index
        minority = {leader, 3}
        majority = everyone - minority
        bed5.partition([sorted(minority), sorted(majority)])
        cut_at = time.time()
        nodes.wait_for("the majority re-forming", full_round(nodes, majority, cut_at))
        # Stay cut long enough for every minority node's calls to end (bounded).
        settle = time.time()
        nodes.wait_for(
            "a failed next_rendezvous on each minority node",
            rendezvous_failed(nodes, minority, settle),
            timeout=2 * CALL_DEADLINE + 30,
        )
        # The keep-alive bound after the cut: a round whose last write landed
        # before the cut may still be reported just after it.
        grace = cut_at + KEEP_ALIVE * ATTEMPTS + 2.0
        during = [(i, ln) for i, ln in nodes.rounds(grace) if i in minority]
        healed_at = time.time()
        bed5.heal()
        nodes.wait_for("all five re-forming after healing", full_round(nodes, everyone, healed_at))
        nodes.stop()  # before etcd stops: a stopping member's refusals are not this test's
    minority_rounds = [(i, ln) for i, ln in during if ln["at"] < healed_at]
    assert minority_rounds == [], f"the minority completed rounds while cut off: {minority_rounds}"
    check_no_two_groups_complete_one_round(nodes)
    check_calls_bounded(nodes)


@pytest.mark.timeout(240)
def test_c10d_store_host_cut_off_from_half_the_nodes(bed5: NetnsBed, nodes: Nodes) -> None:
    """The store lives with the node on host 0; hosts 3 and 4 lose it, 1 and 2 keep it.

    Hosts 3 and 4 get errors within their deadlines (no hang); hosts 0-2
    (at least ``min_nodes``) re-form without them; after healing all five
    form one round.
    """
    endpoint = f"{bed5.hosts[0].ipv4}:{C10D_PORT}"
    for host in bed5.hosts:
        nodes.start(host, "c10d", endpoint)
    everyone = set(range(5))
    nodes.wait_for("a round of all five", full_round(nodes, everyone, 0.0))
    cut_off = {3, 4}
    bed5.cut([(0, 3), (0, 4)])
    cut_at = time.time()
    nodes.wait_for("hosts 0-2 re-forming", full_round(nodes, {0, 1, 2}, cut_at))
    nodes.wait_for(
        "a failed next_rendezvous on each cut-off node",
        rendezvous_failed(nodes, cut_off, cut_at),
        timeout=2 * CALL_DEADLINE + 30,
    )
    healed_at = time.time()
    bed5.heal()
    nodes.wait_for("all five re-forming after healing", full_round(nodes, everyone, healed_at))
    check_no_two_groups_complete_one_round(nodes)
    check_calls_bounded(nodes)


@pytest.mark.timeout(300)
def test_c10d_store_host_cut_off_from_every_other_node(bed5: NetnsBed, nodes: Nodes) -> None:
    """Host 0 (the store, and a node) isolated: every node's calls end in bounded errors.

    The others cannot reach the store; host 0's node is alone, below
    ``min_nodes``. After healing all five form one round.
    """
    endpoint = f"{bed5.hosts[0].ipv4}:{C10D_PORT}"
    for host in bed5.hosts:
        nodes.start(host, "c10d", endpoint)
    everyone = set(range(5))
    nodes.wait_for("a round of all five", full_round(nodes, everyone, 0.0))
    bed5.isolate(0)
    cut_at = time.time()
    nodes.wait_for(
        "a failed next_rendezvous on every node",
        rendezvous_failed(nodes, everyone, cut_at),
        timeout=2 * CALL_DEADLINE + 30,
    )
    healed_at = time.time()
    bed5.heal()
    nodes.wait_for("all five re-forming after healing", full_round(nodes, everyone, healed_at))
    check_no_two_groups_complete_one_round(nodes)
    check_calls_bounded(nodes)
