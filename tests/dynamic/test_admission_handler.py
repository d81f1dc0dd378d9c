"""The admission rules through the real handler: threads as nodes, the in-memory backend, fake time."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from rdzv.dynamic.admission import Admission
from rdzv.dynamic.admission_options import NodeAdmission
from rdzv.dynamic.handler import DynamicRendezvousHandler
from rdzv.errors import RendezvousGracefulExitError
from rdzv.testing import InMemoryBackend
from tests.dynamic.test_handler import Cluster, _check_round, cluster_factory  # noqa: F401
from tests.procs import wait_until

pytestmark = pytest.mark.timeout(120)


def _handler(
    c: Cluster, addr: str, rules: Admission, topology: str = ""
) -> DynamicRendezvousHandler:
    h = DynamicRendezvousHandler.from_backend(
        "job",
        c.store,
        InMemoryBackend(c.storage, c.clock),
        c.min_nodes,
        c.max_nodes,
        local_addr=addr,
        timeout=c.timeout,
        keep_alive_interval=0.2,
        keep_alive_max_attempt=3,
        clock=c.clock,
        admission=NodeAdmission(rules, topology),
    )
    c.handlers.append(h)
    return h


@pytest.mark.slow  # about 2-3 s
def test_a_node_multiple_round_leaves_a_spare_that_waits_past_its_join_timeout(
    cluster_factory: Callable[..., Cluster],  # noqa: F811
) -> None:
    c = cluster_factory(1, 4, join=10, last_call=0.3)
    rules = Admission(node_multiple=2)
    nodes = [_handler(c, f"m{i}", rules) for i in range(3)]
    futures = c.join(nodes)
    wait_until(lambda: sum(f.done() for f in futures) == 2, what="a round of two")
    first = [f.result(timeout=40) for f in futures if f.done()]
    _check_round(first)
    assert first[0].world_size == 2
    (spare,) = [f for f in futures if not f.done()]
    members = [n for n, f in zip(nodes, futures, strict=True) if f is not spare]
    assert [m.num_nodes_waiting() for m in members] == [0, 0], "one spare cannot make 4"
    c.after(15)  # past the join timeout: a spare of a running round waits on
    assert not spare.done()
    fourth = _handler(c, "m3", rules)
    later = c.join([fourth])
    wait_until(lambda: all(m.num_nodes_waiting() == 2 for m in members), what="two waiting")
    again = [f.result(timeout=40) for f in [*c.join(members), spare, later[0]]]
    _check_round(again)
    assert again[0].world_size == 4
    members[0].set_closed()


def test_a_spare_left_by_node_multiple_exits_gracefully_when_the_run_closes(
    cluster_factory: Callable[..., Cluster],  # noqa: F811
) -> None:
    c = cluster_factory(1, 3, join=10, last_call=0.3)
    rules = Admission(node_multiple=2)  # rounds of 2 only: the third node is a spare
    nodes = [_handler(c, f"g{i}", rules) for i in range(3)]
    futures = c.join(nodes)
    wait_until(lambda: sum(f.done() for f in futures) == 2, what="a round of two")
    (spare,) = [f for f in futures if not f.done()]
    done = next(n for n, f in zip(nodes, futures, strict=True) if f.done())
    done.set_closed()
    with pytest.raises(RendezvousGracefulExitError):
        spare.result(timeout=40)


def test_a_target_seals_at_once_without_the_last_call(
    cluster_factory: Callable[..., Cluster],  # noqa: F811
) -> None:
    c = cluster_factory(2, 4, join=600, last_call=300)
    rules = Admission(target_nodes=3)
    began = c.clock()
    infos = [f.result(timeout=40) for f in c.join([_handler(c, f"t{i}", rules) for i in range(3)])]
    _check_round(infos)
    assert infos[0].world_size == 3
    assert c.clock() - began < 300, "the round waited the last call"


@pytest.mark.slow  # about 2-3 s
def test_segments_admit_whole_groups_and_members_re_form_when_one_completes(
    cluster_factory: Callable[..., Cluster],  # noqa: F811
) -> None:
    c = cluster_factory(2, 4, join=10, last_call=0.3)
    rules = Admission(rank_order_key="SW", segment_size=2)

    def node(addr: str, switch: str) -> DynamicRendezvousHandler:
        return _handler(c, addr, rules, switch)

    nodes = [node("s1", "a"), node("s2", "b"), node("s3", "a"), node("s4", "c")]
    try:
        futures = c.join(nodes)
        wait_until(lambda: sum(f.done() for f in futures) == 2, what="the segment of a")
        first = [f.result(timeout=40) for f in futures if f.done()]
        _check_round(first)
        members = [n for n, f in zip(nodes, futures, strict=True) if f.done()]
        assert {m.node for m in members} == {nodes[0].node, nodes[2].node}
        assert [m.num_nodes_waiting() for m in members] == [0, 0], "b and c make no segment"
        c.after(15)  # past the join timeout: the spares wait on
        assert sum(f.done() for f in futures) == 2
        later = c.join([node("s5", "c")])
        wait_until(lambda: all(m.num_nodes_waiting() > 0 for m in members), what="c complete")
        again = c.join(members)
        wait_until(lambda: all(f.done() for f in [*again, later[0], futures[3]]), what="a and c")
        infos = [f.result(timeout=40) for f in [*again, later[0], futures[3]]]
        _check_round(infos)
        assert infos[0].world_size == 4
        assert not futures[1].done(), "b still waits"
        members[0].set_closed()
        with pytest.raises(RendezvousGracefulExitError):
            futures[1].result(timeout=40)
    finally:
        nodes[0].set_closed()  # the spares end: a failure above reports instead of hanging
