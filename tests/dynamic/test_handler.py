"""The handler in one process: threads as nodes, the in-memory backend, short timeouts.

Every ``Cluster`` runs its nodes on one shared :class:`~rdzv.testing.AutojumpClock`
(each node's view skewed as it asks): time moves only while every join and
keep-alive waits, so who is judged dead and which join times out is decided by
fake time alone, however loaded the machine. The ``_pair`` tests below run on
real time: they measure when the ring is read against real confirmations.
"""

import contextlib
import errno
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from rdzv.api import RendezvousInfo, RendezvousStoreInfo, RendezvousTimeout
from rdzv.backends.base import RendezvousBackend, Token
from rdzv.dynamic.bootstrap import HeldPort
from rdzv.dynamic.handler import DynamicRendezvousHandler
from rdzv.dynamic.state import JoinRecord, decode_state, encode_record
from rdzv.errors import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousExhaustedError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
)
from rdzv.store.base import Store
from rdzv.store.memory import HashStore
from rdzv.testing import AutojumpClock, InMemoryBackend, InMemoryRendezvousStorage
from tests.procs import NotReachedError, wait_until

# The result() bounds of 40 s only catch hangs: a loaded machine is slow, not hung
# (a 10 s bound failed a three-node formation beside a second suite).
pytestmark = pytest.mark.timeout(120)

# Real seconds a test waits for its own threads before it calls them hung.
_HANG = 30.0


class PlainBackend(RendezvousBackend):
    """Only the base contract: no watch, no queue, no liveness."""

    def __init__(self, inner: InMemoryBackend) -> None:
        self.inner = inner

    @property
    def name(self) -> str:
        return "plain"

    def get_state(self) -> tuple[bytes, Token] | None:
        return self.inner.get_state()

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        return self.inner.set_state(state, token)


class Cluster:
    def __init__(self, min_nodes: int, max_nodes: int, plain: bool = False, **timeouts: float):
        self.store = HashStore(timeout=5)
        self.storage = InMemoryRendezvousStorage()
        self.min_nodes, self.max_nodes, self.plain = min_nodes, max_nodes, plain
        self.timeout = RendezvousTimeout(
            join=timeouts.get("join", 10), last_call=timeouts.get("last_call", 0.3)
        )
        self.handlers: list[DynamicRendezvousHandler] = []
        self.pool = ThreadPoolExecutor(max_workers=16)
        self.clock = AutojumpClock()

    def handler(
        self, addr: str, node_rank: int | None = None, skew: float = 0.0
    ) -> DynamicRendezvousHandler:
        clock = self.clock.skewed(skew)
        backend: RendezvousBackend = InMemoryBackend(self.storage, clock)
        if self.plain:
            backend = PlainBackend(backend)  # type: ignore[arg-type]
        h = DynamicRendezvousHandler.from_backend(
            "job",
            self.store,
            backend,
            self.min_nodes,
            self.max_nodes,
            local_addr=addr,
            timeout=self.timeout,
            keep_alive_interval=0.2,
            keep_alive_max_attempt=3,
            node_rank=node_rank,
            clock=clock,
        )
        self.handlers.append(h)
        return h

    def join(self, handlers: list[DynamicRendezvousHandler]) -> list[Future[RendezvousInfo]]:
        """Start ``handlers``' joins together: no time passes until every one runs on the clock.

        Without the hold, a join whose thread had not started yet was not
        waited for: the first node alone waited out the last call, sealed a
        round of one, and the late nodes' round waited for it until the join
        timeout.
        """
        started = threading.Barrier(len(handlers) + 1)

        def join(handler: DynamicRendezvousHandler) -> RendezvousInfo:
            with self.clock.running():
                started.wait(timeout=_HANG)
                return handler.next_rendezvous()

        with self.clock.running():
            futures = [self.pool.submit(join, h) for h in handlers]
            started.wait(timeout=_HANG)
        return futures

    def after(self, seconds: float) -> None:
        """Block (real time, bounded) until the fake clock moved ``seconds`` on."""
        reading = self.clock() + seconds
        wait_until(lambda: self.clock() >= reading)

    def close(self) -> None:
        for h in self.handlers:
            h.pre_shutdown()
        self.pool.shutdown(wait=True)
        self.clock.close()


@pytest.fixture
def cluster_factory() -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(*args: object, **kwargs: object) -> Cluster:
        c = Cluster(*args, **kwargs)  # type: ignore[arg-type]
        made.append(c)
        return c

    try:
        yield make
    finally:
        for c in made:
            c.close()


def _check_round(infos: list[RendezvousInfo]) -> None:
    assert sorted(i.rank for i in infos) == list(range(len(infos)))
    assert {i.world_size for i in infos} == {len(infos)}
    assert len({i.participants for i in infos}) == 1
    assert len({i.bootstrap_store_info for i in infos}) == 1


@pytest.mark.parametrize("plain", [False, True], ids=["capable", "plain-backend"])
def test_max_nodes_form_a_round_at_once(
    cluster_factory: Callable[..., Cluster], plain: bool
) -> None:
    c = cluster_factory(2, 4, plain=plain, last_call=30)
    handlers = [c.handler(f"node{i}") for i in (66, 7, 100, 8)]
    infos = [f.result(timeout=40) for f in c.join(handlers)]
    _check_round(infos)
    assert infos[0].participants == ("node7", "node8", "node66", "node100")
    assert infos[1].rank == 0  # node7
    assert infos[0].bootstrap_store_info is not None
    assert infos[0].bootstrap_store_info.master_addr == "node7"


def test_last_call_admits_stragglers_then_seals(cluster_factory: Callable[..., Cluster]) -> None:
    c = cluster_factory(2, 4, last_call=0.5)
    queue = InMemoryBackend(c.storage)
    with c.clock.running():  # no time passes until the straggler enqueued
        first = c.join([c.handler("a1"), c.handler("a2")])
        wait_until(lambda: queue.queue_length(0) == 2)
        third = c.join([c.handler("a3")])
        wait_until(lambda: queue.queue_length(0) == 3)
    infos = [f.result(timeout=40) for f in first + third]
    _check_round(infos)
    assert infos[0].world_size == 3


def test_explicit_distinct_node_ranks_are_honoured(cluster_factory: Callable[..., Cluster]) -> None:
    c = cluster_factory(3, 3)
    handlers = [
        c.handler("h1", node_rank=2),
        c.handler("h2", node_rank=0),
        c.handler("h3", node_rank=1),
    ]
    infos = [f.result(timeout=40) for f in c.join(handlers)]
    assert [i.rank for i in infos] == [2, 0, 1]


def test_join_timeout_without_min_is_exhausted(cluster_factory: Callable[..., Cluster]) -> None:
    c = cluster_factory(2, 2, join=0.3)
    with pytest.raises(RendezvousExhaustedError, match="min nodes"):
        c.handler("lonely").next_rendezvous()


def test_late_joiner_waits_and_is_admitted_next_round(
    cluster_factory: Callable[..., Cluster],
) -> None:
    c = cluster_factory(2, 3, last_call=0.2)
    members = [c.handler("m1"), c.handler("m2")]
    infos = [f.result(timeout=40) for f in c.join(members)]
    assert infos[0].world_size == 2
    assert members[0].num_nodes_waiting() == 0
    late = c.join([c.handler("m3")])
    wait_until(lambda: members[0].num_nodes_waiting() > 0)
    assert not late[0].done()  # waits: no second group
    again = [f.result(timeout=40) for f in c.join(members) + late]
    _check_round(again)
    assert again[0].world_size == 3
    assert again[0].participants[:2] == infos[0].participants  # survivors keep their order


def test_members_re_forming_without_a_newcomer_wait_no_last_call(
    cluster_factory: Callable[..., Cluster],
) -> None:
    """Workers failed, every member re-joins: the round seals at once, not after 30 s."""
    c = cluster_factory(2, 3, last_call=30, join=100)
    members = [c.handler("r1"), c.handler("r2")]
    first = [f.result(timeout=40) for f in c.join(members)]
    assert first[0].world_size == 2
    began = c.clock()
    again = [f.result(timeout=40) for f in c.join(members)]
    _check_round(again)
    assert again[0].participants == first[0].participants
    assert c.clock() - began < 30


def test_a_lost_member_costs_the_survivors_its_dead_node_timeout_not_a_last_call(
    cluster_factory: Callable[..., Cluster],
) -> None:
    c = cluster_factory(2, 3, last_call=30, join=100)
    nodes = [c.handler(f"l{i}") for i in range(3)]
    [f.result(timeout=40) for f in c.join(nodes)]
    nodes[1].pre_shutdown()  # stops heart-beating, as a SIGKILLed node would
    began = c.clock()
    again = [f.result(timeout=40) for f in c.join([nodes[0], nodes[2]])]
    _check_round(again)
    assert again[0].world_size == 2
    assert c.clock() - began < 30  # the dead-node timeout (0.6 s) and a beat or two


def test_a_re_formation_that_admits_a_newcomer_waits_the_last_call(
    cluster_factory: Callable[..., Cluster],
) -> None:
    c = cluster_factory(2, 4, last_call=30, join=100)
    members = [c.handler("n1"), c.handler("n2")]
    [f.result(timeout=40) for f in c.join(members)]
    began = c.clock()
    late = c.join([c.handler("n3")])
    wait_until(lambda: members[0].num_nodes_waiting() > 0)
    again = [f.result(timeout=40) for f in c.join(members) + late]
    _check_round(again)
    assert again[0].world_size == 3
    assert c.clock() - began >= 30  # a fourth node may be on its way too


def test_member_dead_after_completion_is_detected(cluster_factory: Callable[..., Cluster]) -> None:
    c = cluster_factory(2, 3)
    nodes = [c.handler(f"d{i}") for i in range(3)]
    [f.result(timeout=40) for f in c.join(nodes)]
    c.after(1.3)  # > two dead-node timeouts (0.2 s x 3)
    assert all(h.num_nodes_waiting() == 0 for h in nodes)
    nodes[1].pre_shutdown()  # stops heart-beating, as a SIGKILLed node would
    wait_until(lambda: nodes[0].num_nodes_waiting() > 0 and nodes[2].num_nodes_waiting() > 0)
    again = [f.result(timeout=40) for f in c.join([nodes[0], nodes[2]])]
    _check_round(again)
    assert again[0].world_size == 2


def test_clock_skew_neither_kills_the_living_nor_saves_the_dead(
    cluster_factory: Callable[..., Cluster],
) -> None:
    c = cluster_factory(3, 3)
    skewed = c.handler("s0", skew=3600.0)
    normal = [c.handler("s1"), c.handler("s2", skew=-3600.0)]
    [f.result(timeout=40) for f in c.join([skewed, *normal])]
    c.after(1.3)  # > 2 dead-node timeouts (0.2 s x 3)
    assert all(h.num_nodes_waiting() == 0 for h in [skewed, *normal])
    skewed.pre_shutdown()
    wait_until(lambda: normal[0].num_nodes_waiting() > 0)


def test_keep_alive_gives_up_with_a_clear_error_and_restarts_on_the_next_join(
    cluster_factory: Callable[..., Cluster],
) -> None:
    c = cluster_factory(1, 1)
    h = c.handler("k1")
    c.join([h])[0].result(timeout=40)
    c.storage.fail_next(10_000)
    wait_until(lambda: not h.statistics().keepalive_running)
    c.storage.fail_next(0)
    for _ in range(2):  # every call says so until the node joins again
        with pytest.raises(RendezvousConnectionError, match="gave up after 3 failed keep-alive"):
            h.num_nodes_waiting()
    info = h.next_rendezvous()
    assert info.world_size == 1
    assert h.statistics().keepalive_running
    assert h.num_nodes_waiting() == 0


def test_closed_run_rejects_joins(cluster_factory: Callable[..., Cluster]) -> None:
    c = cluster_factory(1, 2, last_call=0.1)
    h = c.handler("c1")
    assert not h.is_closed()
    h.set_closed()
    h.set_closed()  # idempotent
    assert c.handler("c2").is_closed()
    with pytest.raises(RendezvousClosedError, match="'job' is closed"):
        c.handler("c3").next_rendezvous()


def test_spares_exit_gracefully_when_the_run_closes(
    cluster_factory: Callable[..., Cluster],
) -> None:
    c = cluster_factory(2, 2)
    members = [c.handler("p1"), c.handler("p2")]
    [f.result(timeout=40) for f in c.join(members)]
    spare = c.join([c.handler("p3")])
    time.sleep(0.2)
    assert not spare[0].done()
    assert members[0].num_nodes_waiting() == 0  # spares do not trigger re-rendezvous
    members[0].set_closed()
    with pytest.raises(RendezvousGracefulExitError):
        spare[0].result(timeout=40)


@pytest.mark.parametrize("plain", [False, True], ids=["capable", "plain-backend"])
def test_member_rejoining_a_full_round_makes_the_others_reform(
    cluster_factory: Callable[..., Cluster], plain: bool
) -> None:
    # A member whose workers failed calls next_rendezvous() again while the
    # round is full: the others must see it waiting, not take it for a spare.
    c = cluster_factory(3, 3, plain=plain)
    nodes = [c.handler(f"f{i}") for i in range(3)]
    first = [f.result(timeout=40) for f in c.join(nodes)]
    assert first[0].world_size == 3
    assert [n.num_nodes_waiting() for n in nodes] == [0, 0, 0]
    rejoin = c.join([nodes[1]])
    wait_until(lambda: nodes[0].num_nodes_waiting() > 0 and nodes[2].num_nodes_waiting() > 0)
    assert not rejoin[0].done()
    again = [f.result(timeout=40) for f in c.join([nodes[0], nodes[2]]) + rejoin]
    _check_round(again)
    assert again[0].world_size == 3
    assert again[0].participants == first[0].participants


def test_many_members_rejoining_at_once_write_little(
    cluster_factory: Callable[..., Cluster],
) -> None:
    # Leaving before re-joining stops at the first member that left: the
    # others already know to re-form and need not write.
    c = cluster_factory(6, 6)
    nodes = [c.handler(f"w{i}") for i in range(6)]
    [f.result(timeout=40) for f in c.join(nodes)]
    failed_before = c.storage.counts.failed_cas
    again = [f.result(timeout=40) for f in c.join(nodes)]
    _check_round(again)
    assert again[0].world_size == 6
    # Each of the other five loses at most one race before it sees that a
    # member already left (evicting itself each would lose 5+4+3+2+1).
    assert c.storage.counts.failed_cas - failed_before <= 5


def test_shutdown_leaves_and_survivors_reform(cluster_factory: Callable[..., Cluster]) -> None:
    c = cluster_factory(1, 3)
    nodes = [c.handler(f"q{i}") for i in range(3)]
    [f.result(timeout=40) for f in c.join(nodes)]
    assert nodes[2].shutdown()
    assert nodes[0].num_nodes_waiting() > 0
    assert not nodes[0].is_closed()
    again = [f.result(timeout=40) for f in c.join(nodes[:2])]
    assert again[0].world_size == 2


def test_every_transition_is_one_structured_event(
    cluster_factory: Callable[..., Cluster], caplog: pytest.LogCaptureFixture
) -> None:
    logger = logging.getLogger("rdzv.dynamic")
    assert logger.handlers == []
    c = cluster_factory(1, 1)
    h = c.handler("e1")
    with caplog.at_level(logging.INFO, logger="rdzv.dynamic"):
        h.next_rendezvous()
    events = [r.rdzv_event for r in caplog.records if hasattr(r, "rdzv_event")]
    actions = [e["action"] for e in events]
    assert actions == ["join", "enqueue", "sealed", "complete"]
    for event in events:
        assert event["run_id"] == "job"
        assert event["node"] == h.node
        assert event["round"] == 0


def test_waiting_events_give_the_time_left_of_the_last_call(
    cluster_factory: Callable[..., Cluster], caplog: pytest.LogCaptureFixture
) -> None:
    c = cluster_factory(2, 3, last_call=30, join=60)
    nodes = [c.handler("l1"), c.handler("l2")]
    started = c.clock()
    with caplog.at_level(logging.INFO, logger="rdzv.dynamic"):
        infos = [f.result(timeout=40) for f in c.join(nodes)]
    assert [i.world_size for i in infos] == [2, 2]
    assert c.clock() - started >= 30  # the last call was waited out
    events = [r.rdzv_event for r in caplog.records if hasattr(r, "rdzv_event")]
    waiting = [e for e in events if e["action"] == "waiting"]
    assert all(e["last_call_in"] is None for e in waiting if e["joined"] < 2)
    in_call = [e for e in waiting if e["joined"] == 2]
    # Each node reports once that 2 of 2..3 joined, with the time left of
    # the 30 s last call it sees (counted from when it saw them).
    assert sorted(e["node"] for e in in_call) == sorted(n.node for n in nodes)
    assert all(25 < e["last_call_in"] <= 30 for e in in_call), in_call


def test_round_store_is_prefixed_per_round(cluster_factory: Callable[..., Cluster]) -> None:
    c = cluster_factory(1, 1)
    h = c.handler("r1")
    first = h.next_rendezvous()
    first.store.set("k", "round0")
    second = h.next_rendezvous()
    assert second.store.check(["MASTER_ADDR"])
    assert not second.store.check(["k"])


def test_backend_name_and_run_id(cluster_factory: Callable[..., Cluster]) -> None:
    c = cluster_factory(1, 1)
    h = c.handler("n1")
    assert h.get_backend() == "memory"
    assert h.get_run_id() == "job"
    assert not h.use_agent_store
    thread_count = threading.active_count()
    h.next_rendezvous()
    assert threading.active_count() == thread_count + 1  # the keep-alive thread
    h.shutdown()
    assert threading.active_count() == thread_count


def test_a_round_whose_members_all_died_does_not_block_the_next(
    cluster_factory: Callable[..., Cluster],
) -> None:
    c = cluster_factory(2, 2)
    old = [c.handler("o1"), c.handler("o2")]
    [f.result(timeout=40) for f in c.join(old)]
    for h in old:
        h.pre_shutdown()  # both stop heart-beating: the whole job crashed
    fresh = [c.handler("f1"), c.handler("f2")]
    infos = [f.result(timeout=40) for f in c.join(fresh)]
    _check_round(infos)
    assert infos[0].participants == ("f1", "f2")


def test_the_seal_publishes_rank0s_address_so_nobody_waits_for_rank0(
    cluster_factory: Callable[..., Cluster], monkeypatch: pytest.MonkeyPatch
) -> None:
    c = cluster_factory(3, 3)
    c.store.set_timeout(60)  # waiting for rank 0 would fail the result() bounds
    dying = c.handler("r0", node_rank=0)
    others = [c.handler("r1", node_rank=1), c.handler("r2", node_rank=2)]
    build = RendezvousStoreInfo.build

    def dies_at_rank0(
        rank: int, store: Store, local_addr: str | None = None, server_port: int | None = None
    ) -> RendezvousStoreInfo:
        if rank == 0:
            raise RuntimeError("rank 0 died before publishing its address")
        return build(rank, store, local_addr, server_port)

    monkeypatch.setattr(RendezvousStoreInfo, "build", staticmethod(dies_at_rank0))
    futures = c.join([dying, *others])
    with pytest.raises(RuntimeError, match="before publishing"):
        futures[0].result(timeout=40)
    infos = [f.result(timeout=40) for f in futures[1:]]
    boots = {i.bootstrap_store_info for i in infos}
    assert len(boots) == 1
    boot = boots.pop()
    assert boot is not None
    addr, port = boot.master_addr, boot.master_port
    assert addr == "r0"
    assert 0 < port <= 65535
    assert [i.rank for i in infos] == [1, 2]


def test_rank0_dying_before_it_publishes_does_not_hold_the_others_without_a_sealed_port(
    cluster_factory: Callable[..., Cluster],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    c = cluster_factory(2, 3)
    # Records without a port (an older rdzv): the seal names no port and the
    # members wait for rank 0 to publish it in the round's store.
    monkeypatch.setattr(HeldPort, "hold", lambda self: 0)
    c.store.set_timeout(60)  # waiting out the store timeout would fail the result() bounds
    dying = c.handler("r0", node_rank=0)
    others = [c.handler("r1", node_rank=1), c.handler("r2", node_rank=2)]
    build = RendezvousStoreInfo.build

    def dies_at_rank0(
        rank: int, store: Store, local_addr: str | None = None, server_port: int | None = None
    ) -> RendezvousStoreInfo:
        if local_addr == "r0":
            dying.pre_shutdown()  # no more heartbeats, as if SIGKILLed right here
            raise RuntimeError("rank 0 died before publishing its address")
        return build(rank, store, local_addr, server_port)

    monkeypatch.setattr(RendezvousStoreInfo, "build", staticmethod(dies_at_rank0))
    with caplog.at_level(logging.INFO, logger="rdzv.dynamic"):
        futures = c.join([dying, *others])
        with pytest.raises(RuntimeError, match="before publishing"):
            futures[0].result(timeout=40)
        infos = [f.result(timeout=40) for f in futures[1:]]
    events = [r.rdzv_event for r in caplog.records if hasattr(r, "rdzv_event")]
    _check_round(infos)
    assert infos[0].participants == ("r1", "r2")
    broken = [e for e in events if e["action"] == "broken"]
    assert {e["node"] for e in broken} == {others[0].node, others[1].node}
    assert {e["round"] for e in broken} == {0}
    completed = {
        e["round"] for e in events if e["action"] == "complete" and e["node"] != dying.node
    }
    assert completed == {1}


@pytest.mark.slow
def test_a_member_waiting_for_a_live_rank0_that_never_publishes_gives_up_at_its_join_deadline(
    cluster_factory: Callable[..., Cluster], monkeypatch: pytest.MonkeyPatch
) -> None:
    c = cluster_factory(2, 2, join=3)
    # Records without a port (an older rdzv): the seal names none, and rank 1
    # waits for rank 0, which stays a live member but hangs before publishing.
    monkeypatch.setattr(HeldPort, "hold", lambda self: 0)
    c.store.set_timeout(60)  # the wait used to last this long
    hung = threading.Event()
    build = RendezvousStoreInfo.build

    def hangs_at_rank0(
        rank: int, store: Store, local_addr: str | None = None, server_port: int | None = None
    ) -> RendezvousStoreInfo:
        if local_addr == "r0":
            c.clock.wait(hung, 30)
        return build(rank, store, local_addr, server_port)

    monkeypatch.setattr(RendezvousStoreInfo, "build", staticmethod(hangs_at_rank0))
    rank0, rank1 = c.handler("r0", node_rank=0), c.handler("r1", node_rank=1)
    started = c.clock()
    futures = c.join([rank0, rank1])
    try:
        with pytest.raises(
            RendezvousTimeoutError,
            match=r"rank 1 did not see rank 0 publish .* by the join deadline",
        ):
            futures[1].result(timeout=40)
        assert c.clock() - started < 3 + 1  # the join timeout, and one slice of the wait
    finally:
        hung.set()
    assert futures[0].result(timeout=40).rank == 0


def test_a_node_without_a_free_port_joins_and_rank0_publishes_one_after_the_seal(
    cluster_factory: Callable[..., Cluster],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from rdzv.dynamic import bootstrap as bootstrap_module

    c = cluster_factory(3, 3)
    c.store.set_timeout(20)
    bound = bootstrap_module.bound_socket
    tried: list[str] = []

    def no_port_for_r0() -> socket.socket:
        name = threading.current_thread().name
        tried.append(name)
        if name.startswith("r0"):
            raise OSError(errno.EADDRINUSE, "Address already in use")
        return bound()

    monkeypatch.setattr(bootstrap_module, "bound_socket", no_port_for_r0)
    handlers = [c.handler(f"r{i}", node_rank=i) for i in range(3)]
    with caplog.at_level(logging.INFO, logger="rdzv.dynamic"), ThreadPoolExecutor(3) as pool:
        futures = []
        for i, h in enumerate(handlers):
            futures.append(pool.submit(_named, f"r{i}", h.next_rendezvous))
        infos = [f.result(timeout=40) for f in futures]
    _check_round(infos)
    bootstrap = {i.rank: i for i in infos}[0].bootstrap_store_info
    assert bootstrap is not None
    assert bootstrap.master_addr == "r0"
    assert 1 <= bootstrap.master_port <= 65535  # rank 0 published one after the seal
    events = [getattr(r, "rdzv_event", {}) for r in caplog.records]
    failed = [e for e in events if e.get("action") == "port-failed"]
    assert [e["node"] for e in failed] == [handlers[0].node]
    assert "Address already in use" in failed[0]["error"]
    assert sorted(set(tried)) == ["r0", "r1", "r2"]


def _named(name: str, call: Callable[[], RendezvousInfo]) -> RendezvousInfo:
    threading.current_thread().name = name
    return call()


def test_a_store_restarted_empty_strands_nobody(cluster_factory: Callable[..., Cluster]) -> None:
    c = cluster_factory(2, 3, join=60)  # stranding would show as a result() timeout
    members = [c.handler("w1"), c.handler("w2")]
    [f.result(timeout=40) for f in c.join(members)]
    joiner = c.handler("w3")
    waiting = c.join([joiner])[0]  # queued for round 1, which waits for the members
    wait_until(lambda: members[0].num_nodes_waiting() > 0)
    c.storage.wipe()  # the backend and the store restart empty together
    for key in c.store.list_keys():
        c.store.delete_key(key)
    wait_until(lambda: all(h.num_nodes_waiting() > 0 for h in members))  # members are told
    infos = [f.result(timeout=40) for f in [waiting, *c.join(members)]]
    _check_round(infos)
    assert infos[0].world_size == 3
    assert {h.statistics().round for h in [joiner, *members]} == {0}


def test_a_member_dying_while_the_others_rejoin_is_found_by_its_ring_neighbour(
    cluster_factory: Callable[..., Cluster],
) -> None:
    c = cluster_factory(2, 4)
    a, b, d = c.handler("a", node_rank=0), c.handler("b", node_rank=1), c.handler("d", node_rank=2)
    [f.result(timeout=40) for f in c.join([a, b, d])]
    a.pre_shutdown()  # a and d stop heart-beating, as if SIGKILLed
    d.pre_shutdown()
    again = c.join([b])[0]  # b re-joins at once: before it could judge d as a member
    backend = InMemoryBackend(c.storage)
    wait_until(lambda: backend.queue_length(1) == 1)
    # The last-call leader (position 2 = min_nodes) dies right after enqueueing, so
    # no leader judges the missing a and d; only b, a's and d's ring neighbour, can.
    backend.enqueue(1, encode_record(JoinRecord("ghost#1#dead", -1)))
    e = c.handler("e")
    infos = [f.result(timeout=40) for f in [again, *c.join([e])]]
    # A round that admitted the ghost never completes: it cannot confirm.
    _check_round(infos)
    assert set(infos[0].participants) == {"b", "e"}


def test_members_re_joining_together_write_one_leave(
    cluster_factory: Callable[..., Cluster],
) -> None:
    # Every compare-and-set of the state writes the whole participant list;
    # a thousand members re-joining at once (a scale-up, a lost peer) used to
    # race with a thousand of them. The barrier makes the race certain: the
    # leaves that try to write meet there before any of them writes.
    c = cluster_factory(3, 3)
    handlers = [c.handler(f"n{i}") for i in range(3)]
    first = [f.result(timeout=40) for f in c.join(handlers)]
    _check_round(first)
    attempts: list[bytes] = []
    meet = threading.Barrier(3, timeout=1)
    backends = [h.backend for h in handlers]
    for backend in backends:
        assert isinstance(backend, InMemoryBackend)
        # A seated backend takes every write with the state's summary.
        real = backend.set_state_seated

        def gated(
            state: bytes,
            token: Token | None,
            seats: Mapping[str, bytes],
            real: Callable[..., object] = real,
        ) -> object:
            if decode_state(state).round == 0:  # a leave: round 0 with a member evicted
                attempts.append(state)
                with contextlib.suppress(threading.BrokenBarrierError):
                    meet.wait()
            return real(state, token, seats)

        backend.set_state_seated = gated  # type: ignore[method-assign,assignment]
    second = [f.result(timeout=40) for f in c.join(handlers)]
    _check_round(second)
    assert second[0].world_size == 3
    assert len(attempts) == 1, f"{len(attempts)} members wrote a leave of round 0"


class _HeldConfirmer(InMemoryBackend):
    """Records when its ring marks are read; runs ``hold`` before its node confirms."""

    def __init__(
        self,
        storage: InMemoryRendezvousStorage,
        reads: list[float],
        hold: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(storage)
        self.reads, self.hold = reads, hold
        self.released: list[float] = []  # shared with the confirmation view (a shallow copy)

    def enqueue(self, round_id: int, record: bytes) -> int:
        if self._queue_name == "confirm" and self.hold is not None:
            self.hold()
            self.released.append(time.monotonic())
        return super().enqueue(round_id, record)

    def heartbeat_mark(self, node: str) -> bytes | None:
        self.reads.append(time.monotonic())
        return super().heartbeat_mark(node)

    def heartbeat_marks(self, nodes: Sequence[str]) -> dict[str, bytes | None]:
        # The sealer's one read of every member's mark for the seats, not a
        # ring reading: unrecorded.
        return {node: InMemoryBackend.heartbeat_mark(self, node) for node in nodes}


def _pair(
    storage: InMemoryRendezvousStorage, backends: list[_HeldConfirmer], interval: float
) -> list[DynamicRendezvousHandler]:
    store = HashStore(timeout=5)
    return [
        DynamicRendezvousHandler.from_backend(
            "job", store, backend, 2, 2, local_addr=addr, keep_alive_interval=interval
        )
        for addr, backend in zip(("a", "b"), backends, strict=True)
    ]


def _form(handlers: list[DynamicRendezvousHandler]) -> None:
    try:
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(h.next_rendezvous) for h in handlers]
            _check_round([f.result(timeout=60) for f in futures])
    finally:
        for h in handlers:
            h.shutdown()


def test_the_ring_is_first_read_at_the_verdict_not_while_the_members_confirm() -> None:
    # The first reading of a ring only sets its baseline. At 2,048 members
    # (confirming over a second and more) those readings made one request in
    # ten of a formation and competed with the confirmations.
    storage = InMemoryRendezvousStorage()
    reads: list[float] = []
    late = _HeldConfirmer(storage, [], hold=lambda: time.sleep(1.5))  # two ring periods
    # Dead after 30 s: readings every 0.75 s, the confirmation's slices 7.5 s.
    _form(_pair(storage, [_HeldConfirmer(storage, reads), late], interval=10.0))
    (released,) = late.released
    early = [round(t - released, 3) for t in reads if t < released]
    assert not early, f"the ring was read {early} s before the last member confirmed"


def test_a_member_that_rejoins_judges_its_old_ring_until_the_new_round_is_confirmed() -> None:
    # In a recovery of 1,024 nodes the 1,023 survivors' keep-alives switched
    # to the new ring as they began to confirm, and its first readings
    # competed with the confirmations; the old ring is still the one to
    # watch until then (a member that died while the others re-joined).
    storage = InMemoryRendezvousStorage()
    armed, a_confirming = threading.Event(), threading.Event()
    watched: list[int | None] = []

    def hold_a() -> None:
        if armed.is_set():
            a_confirming.set()

    def hold_b() -> None:  # b confirms round 1 once a is confirming it too
        if armed.is_set():
            assert a_confirming.wait(10), "a never began to confirm"
            seat = handlers[0].statistics().watched
            watched.append(None if seat is None else seat.round)

    backends = [_HeldConfirmer(storage, [], hold=hold_a), _HeldConfirmer(storage, [], hold=hold_b)]
    handlers = _pair(storage, backends, interval=10.0)
    try:
        with ThreadPoolExecutor(2) as pool:
            for round_id in (0, 1):
                if round_id:
                    armed.set()
                infos = [
                    f.result(timeout=60) for f in [pool.submit(h.next_rendezvous) for h in handlers]
                ]
                _check_round(infos)
        seat = handlers[0].statistics().watched
        assert seat is not None
        assert seat.round == 1  # judged from the verdict on
    finally:
        for h in handlers:
            h.shutdown()
    assert watched == [0], f"a judged round {watched} while it confirmed round 1"


def test_the_ring_judging_starts_when_a_confirmation_slice_passes_without_the_verdict() -> None:
    # A member that died in the queue never confirms; its ring predecessor
    # must start judging it while the others wait, not at its next beat.
    storage = InMemoryRendezvousStorage()
    before_verdict: list[bool] = []

    def judging() -> bool:  # a's keep-alive watches round 0's ring
        return handlers[0].statistics().watched is not None

    def hold() -> None:  # b confirms once a's ring judging started (or far past the slice)
        try:
            before_verdict.append(wait_until(judging, "a's ring judging", 30))
        except NotReachedError:
            before_verdict.append(False)

    late = _HeldConfirmer(storage, [], hold=hold)
    # Dead after 3 s: the confirmation's slices 0.75 s.
    handlers = _pair(storage, [_HeldConfirmer(storage, []), late], interval=1.0)
    _form(handlers)
    assert before_verdict == [True], "a's ring judging waited for the verdict"


def test_a_node_that_died_waiting_alone_in_the_queue_completes_no_round(
    cluster_factory: Callable[..., Cluster], caplog: pytest.LogCaptureFixture
) -> None:
    # The chaos harness's late leave across hosts: a node enqueued alone
    # (min_nodes 2) and was SIGKILLed; the last-call leader came seconds later
    # and sealed the round with it, and the members started work beside it.
    c = cluster_factory(2, 3)
    backend = InMemoryBackend(c.storage)
    backend.enqueue(0, encode_record(JoinRecord("ghost#1#dead", -1)))
    backend.beat("ghost#1#dead")  # it beat once before it died
    with caplog.at_level(logging.INFO, logger="rdzv.dynamic"):
        infos = [f.result(timeout=40) for f in c.join([c.handler("a"), c.handler("b")])]
    _check_round(infos)
    assert set(infos[0].participants) == {"a", "b"}
    events = [r.rdzv_event for r in caplog.records if hasattr(r, "rdzv_event")]
    # The first round sealed admitted the ghost: with both or, when b's thread
    # came late on a loaded machine, with a alone (fake time ran out a's last
    # call meanwhile). Either way the ghost was evicted from it before every
    # member confirmed, so that round completed for nobody.
    first = next(e["round"] for e in events if e["action"] == "sealed")
    evicted = [e["evicted"] for e in events if e["action"] == "evict" and e["round"] == first]
    assert ["ghost#1#dead"] in evicted, events
    assert not any(e["action"] == "complete" and e["round"] == first for e in events), events
    assert any(
        e["action"] == "broken" and e["round"] == first and e["reason"] == "a member was lost"
        for e in events
    ), events


@pytest.mark.slow
def test_a_member_alive_but_never_confirming_ends_the_join_at_its_timeout(
    cluster_factory: Callable[..., Cluster],
) -> None:
    c = cluster_factory(3, 3, join=2.0)
    backend = InMemoryBackend(c.storage)
    backend.enqueue(0, encode_record(JoinRecord("mute#1#x", -1)))
    stop = threading.Event()

    def beat() -> None:  # alive (never judged dead), but it never reads the seal
        with c.clock.running():
            while not c.clock.wait(stop, 0.05):
                backend.beat("mute#1#x")

    beater = threading.Thread(target=beat)
    beater.start()
    try:
        futures = c.join([c.handler("a"), c.handler("b")])
        for f in futures:
            with pytest.raises(
                RendezvousTimeoutError,
                match=r"2 of 3 members confirmed it .*; not confirmed: mute#1#x$",
            ):
                f.result(timeout=40)
    finally:
        stop.set()
        beater.join()


def test_a_queue_whose_admitted_nodes_all_died_does_not_block_the_spares(
    cluster_factory: Callable[..., Cluster],
) -> None:
    c = cluster_factory(2, 2)
    old = [c.handler("o1"), c.handler("o2")]
    [f.result(timeout=40) for f in c.join(old)]
    for h in old:
        h.pre_shutdown()  # the whole job died: the members of round 0 ...
    backend = InMemoryBackend(c.storage)
    for name in ("g1", "g2"):  # ... and the two nodes admitted to round 1, right after enqueueing
        backend.enqueue(1, encode_record(JoinRecord(f"{name}#1#dead", -1)))
    spares = [c.handler("s1"), c.handler("s2")]  # positions 3 and 4: beyond max_nodes
    infos = [f.result(timeout=40) for f in c.join(spares)]
    _check_round(infos)
    assert set(infos[0].participants) == {"s1", "s2"}


def test_a_joiner_that_died_in_the_queue_while_the_seal_waited_is_left_out(
    cluster_factory: Callable[..., Cluster], caplog: pytest.LogCaptureFixture
) -> None:
    # The chaos harness's one late leave across hosts: a node enqueued and was
    # SIGKILLed; the seal, deferred because the last round's members had not
    # re-joined, waited until they were judged dead, and its leader then
    # admitted the killed node too, 9 s after its death.
    c = cluster_factory(2, 4)
    members = [c.handler("a", node_rank=0), c.handler("b", node_rank=1)]
    [f.result(timeout=40) for f in c.join(members)]
    backend = InMemoryBackend(c.storage)
    # It beat once before it was killed; it ranks after j and k, so a round
    # admitting it completes (a dead rank 0 would break it instead).
    backend.enqueue(1, encode_record(JoinRecord("zghost#1#dead", -1)))
    backend.beat("zghost#1#dead")
    for h in members:
        h.pre_shutdown()  # the whole last round dies, as if SIGKILLed
    leader = c.handler("j")
    with caplog.at_level(logging.INFO, logger="rdzv.dynamic"):
        waiting = c.join([leader])[0]  # position 2 = min_nodes: judges a, b and the ghost

        def judged() -> set[str]:
            events = [r.rdzv_event for r in caplog.records if hasattr(r, "rdzv_event")]
            return {n for e in events if e["action"] == "dead" for n in e["suspects"]}

        wait_until(lambda: {n.split("#")[0] for n in judged()} >= {"a", "b", "zghost"})
        infos = [f.result(timeout=40) for f in [waiting, *c.join([c.handler("k")])]]
    _check_round(infos)
    assert set(infos[0].participants) == {"j", "k"}
