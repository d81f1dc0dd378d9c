"""The admission rules (issue 52: target size, size granularity, slots kept, topology order).

Unit tests of each rule in :mod:`rdzv.dynamic.admission` and the machine,
property tests of :func:`admit` on random queues, and the random
interleavings of ``test_interleavings`` run under each rule, checking that
every sealed round has an allowed size and that ranks are kept where the
rule promises it.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rdzv.api import RendezvousParameters
from rdzv.dynamic.admission import Admission, admit, grows, round_size
from rdzv.dynamic.admission_options import admission_from_params
from rdzv.dynamic.machine import (
    Fail,
    FailReason,
    Limits,
    Seal,
    Wait,
    decide,
    last_call_left,
    missing_members,
    nodes_waiting,
    observe,
    plan_seal,
    start_join,
)
from rdzv.dynamic.state import (
    JoinRecord,
    RendezvousState,
    assign_ranks,
    decode_record,
    encode_record,
    make_node_key,
    natural_key,
    node_address,
)
from rdzv.errors import RendezvousStateError
from tests.dynamic.test_interleavings import OPS, SKEWS, World, play, settle

N = [make_node_key(f"10.0.0.{i}", 1, "x") for i in range(1, 13)]


def _limits(low: int, high: int, **rules: object) -> Limits:
    admission = Admission(**rules)  # type: ignore[arg-type]
    low, high = admission.bounds(low, high)
    return Limits(low, high, join_timeout=100.0, last_call=10.0, grace=6.0, admission=admission)


def _records(nodes: list[str], topology: dict[str, str] | None = None) -> list[JoinRecord]:
    return [JoinRecord(n, topology=(topology or {}).get(n, "")) for n in nodes]


# -- validation and parsing ---------------------------------------------------


@pytest.mark.parametrize(
    ("rules", "low", "high", "key"),
    [
        ({"node_multiple": 0}, 1, 8, "node_multiple"),
        ({"node_multiple": 4}, 5, 7, "node_multiple"),
        ({"target_nodes": 9}, 1, 8, "target_nodes"),
        ({"target_nodes": 6, "node_multiple": 4}, 1, 8, "target_nodes"),
        ({"segment_size": 2}, 1, 8, "segment_size"),
        ({"segment_size": 4, "rank_order_key": "RACK"}, 1, 3, "segment_size"),
    ],
)
def test_rules_that_do_not_fit_raise_naming_the_key(
    rules: dict[str, object], low: int, high: int, key: str
) -> None:
    with pytest.raises(ValueError, match=key):
        Admission(**rules).bounds(low, high)  # type: ignore[arg-type]


def test_bounds_are_the_multiples_inside_min_and_max() -> None:
    assert Admission(node_multiple=4).bounds(1, 10) == (4, 8)
    assert Admission(node_multiple=2, segment_size=3, rank_order_key="R").bounds(1, 13) == (6, 12)
    assert Admission().bounds(3, 7) == (3, 7)


def _params(**config: str) -> RendezvousParameters:
    return RendezvousParameters("c10d", "localhost:0", "job", 1, 8, config=config)


def test_the_keys_are_read_once_from_the_config() -> None:
    parsed = admission_from_params(
        _params(
            target_nodes="8",
            node_multiple="2",
            keep_ranks="true",
            rank_order_key="RACK",
            segment_size="2",
        ),
        {"RACK": "r1"},
    )
    assert parsed.rules == Admission(8, 2, True, "RACK", 2)
    assert parsed.topology == "r1"
    assert admission_from_params(_params(), {}).rules.default


def test_target_nodes_slurm_reads_the_allocation_size() -> None:
    parsed = admission_from_params(_params(target_nodes="slurm"), {"SLURM_NNODES": "6"})
    assert parsed.rules.target_nodes == 6
    with pytest.raises(ValueError, match="target_nodes=slurm"):
        admission_from_params(_params(target_nodes="slurm"), {})


@pytest.mark.parametrize(
    ("config", "environ", "key"),
    [
        ({"node_multiple": "four"}, {}, "node_multiple"),
        ({"keep_ranks": "maybe"}, {}, "keep_ranks"),
        ({"rank_order_key": "RACK"}, {}, "rank_order_key"),
        ({"rank_order_key": "RACK"}, {"RACK": "a b"}, "rank_order_key"),
        ({"target_nodes": "20"}, {}, "target_nodes"),
    ],
)
def test_bad_values_raise_naming_the_key(
    config: dict[str, str], environ: dict[str, str], key: str
) -> None:
    with pytest.raises(ValueError, match=key):
        admission_from_params(_params(**config), environ)


def test_a_join_record_carries_its_topology() -> None:
    for record in (JoinRecord(N[0], -1, 0, "s1.r2"), JoinRecord(N[0], 3, 4242, "x")):
        assert decode_record(encode_record(record)) == record
    assert encode_record(JoinRecord(N[0], 2, 9)) == f"{N[0]} 2 9".encode()
    with pytest.raises(RendezvousStateError, match="port"):
        decode_record(f"{N[0]} -1 0".encode())
    assert encode_record(JoinRecord(N[0], -1, 0, "s1")) == f"{N[0]} -1 0 t=s1".encode()
    for bad in ("-1 0 a b", "-1 0 t=a b", "-1 0 s1", "-1 0 t=", "-1 7 t=\x01"):
        with pytest.raises(RendezvousStateError):
            decode_record(f"{N[0]} {bad}".encode())


# -- rule 1: a target size ------------------------------------------------------


def test_the_target_leader_seals_at_once_and_below_it_the_last_call_runs() -> None:
    limits = _limits(2, 8, target_nodes=4)
    assert limits.seal_at == 4
    progress = replace(start_join(None, 0.0), position=4)
    progress = observe(progress, None, 4, limits, 0.0)
    assert decide(progress, None, 4, N[3], limits, 0.0) == Seal()
    assert last_call_left(progress, None, 4, limits, 0.0) is None
    early = observe(replace(start_join(None, 0.0), position=2), None, 3, limits, 0.0)
    assert decide(early, None, 3, N[1], limits, 1.0) == Wait(10.0)
    assert last_call_left(early, None, 3, limits, 1.0) == 9.0
    assert decide(early, None, 3, N[1], limits, 10.0) == Seal()


def test_a_round_sealed_at_the_target_still_grows_to_max() -> None:
    limits = _limits(2, 8, target_nodes=4)
    state = RendezvousState(0, tuple(N[:4]))
    assert nodes_waiting(state, 2, N[0], limits) == 2


# -- rule 2: a size granularity -------------------------------------------------


def test_a_round_takes_the_largest_multiple_and_leaves_the_others_waiting() -> None:
    limits = _limits(1, 8, node_multiple=4)
    plan = plan_seal(None, 0, _records(N[:7]), limits)
    assert plan is not None
    assert len(plan.participants) == 4
    assert plan_seal(None, 0, _records(N[:3]), limits) is None
    state = RendezvousState(0, plan.participants)
    assert nodes_waiting(state, 3, N[0], limits) == 0, "three spares cannot make 8"
    assert nodes_waiting(state, 4, N[0], limits) == 4


def test_spares_the_round_cannot_take_wait_without_a_join_timeout() -> None:
    limits = _limits(1, 8, node_multiple=4)
    state = RendezvousState(0, tuple(N[:4]))
    progress = replace(start_join(state, 0.0), position=1)
    progress = observe(progress, state, 2, limits, 500.0)
    assert progress.started_at == 500.0
    assert decide(progress, state, 2, N[5], limits, 550.0) == Wait(600.0)


def test_a_node_behind_a_segment_round_waits_as_a_spare_without_a_join_timeout() -> None:
    limits = _limits(2, 6, rank_order_key="SW", segment_size=2)
    state = RendezvousState(0, tuple(N[:2]))
    progress = observe(replace(start_join(state, 0.0), position=1), state, 1, limits, 900.0)
    assert progress.started_at == 900.0
    assert decide(progress, state.close(), 1, N[7], limits, 901.0) == Fail(FailReason.GRACEFUL_EXIT)


def test_round_size() -> None:
    rules = Admission(node_multiple=3)
    assert [round_size(n, 3, 9, rules) for n in range(11)] == [0, 0, 0, 3, 3, 3, 6, 6, 6, 9, 9]


# -- rule 4: members before spares, slots kept -----------------------------------


def test_members_that_rejoin_come_before_spares_that_queued_earlier() -> None:
    previous = tuple(N[:4])
    queue = _records([N[8], N[9], N[0], N[1], N[2], N[3]])
    for rules in (Admission(), Admission(keep_ranks=True), Admission(node_multiple=2)):
        chosen = admit(queue, previous, 1, 4, rules)
        assert set(chosen) == set(previous), rules


def test_a_member_that_left_and_re_joined_comes_before_an_earlier_spare() -> None:
    # N[3]'s workers failed: it left (evicted) and re-joined after the spare N[9].
    state = RendezvousState(0, tuple(N[:4])).evict([N[3]])
    queue = _records([N[9], N[3], N[0], N[1], N[2]])
    for rules in (Admission(), Admission(keep_ranks=True)):
        plan = plan_seal(state, 1, queue, _limits(4, 4, **vars(rules)))
        assert plan is not None
        assert plan.participants == tuple(N[:4]), rules


def test_with_keep_ranks_the_replacement_takes_the_dead_nodes_rank() -> None:
    previous = tuple(N[:4])
    queue = _records([N[9], N[0], N[1], N[3]])  # N[2] (rank 2) died, N[9] was a spare
    kept = admit(queue, previous, 1, 4, Admission(keep_ranks=True))
    assert kept == (N[0], N[1], N[9], N[3])
    # torch's order (the default, unchanged): survivors close up, the newcomer comes last.
    assert admit(queue, previous, 1, 4, Admission()) == (N[0], N[1], N[3], N[9])


def test_with_keep_ranks_and_no_replacement_only_the_ranks_above_the_gap_move_down() -> None:
    previous = tuple(N[:5])
    queue = _records([N[0], N[1], N[3], N[4]])
    assert admit(queue, previous, 1, 5, Admission(keep_ranks=True)) == (N[0], N[1], N[3], N[4])
    # Two gaps, one replacement: it fills the lower gap.
    queue = _records([N[7], N[0], N[2], N[4]])
    assert admit(queue, previous, 1, 5, Admission(keep_ranks=True)) == (N[0], N[7], N[2], N[4])


# -- rule 5: topology order and whole segments ----------------------------------


def test_ranks_follow_the_rank_order_key_then_the_natural_order() -> None:
    topology = {N[0]: "sw2", N[1]: "sw1", N[2]: "sw2", N[3]: "sw1"}
    chosen = admit(_records(N[:4], topology), (), 1, 4, Admission(rank_order_key="SW"))
    assert chosen == (N[1], N[3], N[0], N[2])


def test_a_round_holds_only_whole_segments() -> None:
    topology = {N[0]: "a", N[1]: "b", N[2]: "a", N[3]: "c", N[4]: "b", N[5]: "a"}
    rules = Admission(rank_order_key="SW", segment_size=2)
    chosen = admit(_records(N[:6], topology), (), 2, 6, rules)
    assert chosen == (N[0], N[2], N[1], N[4]), "c is alone, a's third node waits"
    state = RendezvousState(0, chosen)
    limits = _limits(2, 6, rank_order_key="SW", segment_size=2)
    spares = _records([N[3], N[5]], topology)
    assert nodes_waiting(state, 2, N[0], limits, spares) == 0, "c and a make no segment"
    assert nodes_waiting(state, 2, N[0], limits, None) == 0, "unread: no segment"
    pair = _records([N[3], N[6]], {N[3]: "c", N[6]: "c"})
    assert nodes_waiting(state, 2, N[0], limits, pair) == 2


# -- properties of admit ---------------------------------------------------------

RULES = st.builds(
    Admission,
    target_nodes=st.none(),
    node_multiple=st.sampled_from([1, 1, 2, 3]),
    keep_ranks=st.booleans(),
    rank_order_key=st.sampled_from([None, "SW"]),
    segment_size=st.none(),
) | st.builds(
    Admission,
    node_multiple=st.sampled_from([1, 2]),
    keep_ranks=st.booleans(),
    rank_order_key=st.just("SW"),
    segment_size=st.sampled_from([1, 2, 3]),
)


@settings(max_examples=300, deadline=None)
@given(
    rules=RULES,
    bounds=st.tuples(st.integers(1, 6), st.integers(0, 6)),
    previous=st.lists(st.integers(0, 11), unique=True, max_size=8),
    queued=st.lists(st.integers(0, 11), max_size=16),
    switches=st.lists(st.sampled_from("ab"), min_size=12, max_size=12),
)
def test_admit_keeps_its_promises(
    rules: Admission,
    bounds: tuple[int, int],
    previous: list[int],
    queued: list[int],
    switches: list[str],
) -> None:
    low, high = bounds[0], bounds[0] + bounds[1]
    try:
        low, high = rules.bounds(low, high)
    except ValueError:
        return
    topology = {N[i]: switches[i] for i in range(12)}
    records = _records([N[i] for i in queued], topology)
    before = tuple(N[i] for i in previous)
    chosen = admit(records, before, low, high, rules)
    distinct = list(dict.fromkeys(N[i] for i in queued))
    # Sizes allowed: none, or a multiple of the unit within the bounds.
    assert len(set(chosen)) == len(chosen)
    assert set(chosen) <= set(distinct)
    if len(chosen) >= low:  # a round plan_seal seals
        assert len(chosen) <= high
        assert len(chosen) % rules.unit == 0
    if rules.default:
        assert chosen == assign_ranks(records, before, high)
        return
    assert not chosen or len(chosen) >= low, "the rules return no round below min_nodes"
    if rules.segment_size:
        for value in "ab":
            assert sum(topology[n] == value for n in chosen) % rules.segment_size == 0
    else:
        # Members that re-joined come before any newcomer; the round is as
        # large as the rules allow.
        assert len(chosen) == round_size(len(distinct), low, high, rules)
        if any(n not in before for n in chosen):
            assert {n for n in distinct if n in before} <= set(chosen)
    fresh = [n for n in chosen if n not in before]
    if rules.keep_ranks and before:
        # Slots kept: a member's rank drops by the gaps below it nobody filled.
        gaps = [i for i, n in enumerate(before) if n not in chosen]
        for rank, node in enumerate(chosen):
            if node in before:
                old = before.index(node)
                below = sum(1 for g in gaps if g < old)
                assert rank == old - max(0, below - len(fresh))
    elif rules.rank_order_key:

        def order(n: str) -> tuple[object, ...]:
            return (topology[n], natural_key(node_address(n)), natural_key(n))

        assert list(chosen) == sorted(chosen, key=order)


@given(
    live=st.integers(1, 8),
    queued=st.integers(0, 8),
    bounds=st.tuples(st.integers(1, 4), st.integers(0, 4)),
)
def test_grows_is_todays_rule_by_default(live: int, queued: int, bounds: tuple[int, int]) -> None:
    low, high = bounds[0], bounds[0] + bounds[1]
    assert grows(live, queued, None, low, high, Admission())


# -- the random interleavings under each rule ------------------------------------

DEAD = 3.0
CASES = {
    "target": (Admission(target_nodes=3), ()),
    "multiple": (Admission(node_multiple=2), ()),
    "keep_ranks": (Admission(keep_ranks=True), ()),
    "keep_ranks_multiple": (Admission(keep_ranks=True, node_multiple=2), ()),
    "segments": (Admission(rank_order_key="SW", segment_size=2), ("a", "b", "a", "b", "c")),
    "order": (Admission(rank_order_key="SW"), ("b", "a", "c")),
}


def _check_rounds(world: World, rules: Admission) -> None:
    limits = world.limits
    topology = {n.key: n.topology for n in world.nodes}
    rounds = sorted(world.seen)
    for r in rounds:
        members = world.seen[r]
        assert limits.min_nodes <= len(members) <= limits.max_nodes
        assert len(members) % rules.unit == 0, f"round {r} has {len(members)} members"
        if rules.segment_size:
            for value in set(topology.values()):
                assert sum(topology[n] == value for n in members) % rules.segment_size == 0
    if not rules.keep_ranks:
        return
    for r in rounds:
        before, after = world.seen.get(r - 1), world.seen[r]
        if before is None:
            continue
        fresh = [n for n in after if n not in before]
        gaps = [i for i, n in enumerate(before) if n not in after]
        for rank, node in enumerate(after):
            if node in before:
                old = before.index(node)
                below = sum(1 for g in gaps if g < old)
                assert rank == old - max(0, below - len(fresh)), f"{node} moved in round {r}"


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
@settings(max_examples=25, deadline=None)
@given(
    # One node more than a round takes: a spare from the start.
    st.lists(SKEWS, min_size=5, max_size=5),
    st.lists(st.tuples(OPS, st.integers(0, 7), SKEWS), min_size=1, max_size=120),
)
def test_random_interleavings_under_each_rule_seal_allowed_rounds(
    case: str, first_skews: list[float], ops: list[tuple[str, int, float]]
) -> None:
    rules, topologies = CASES[case]
    low, high = rules.bounds(2, 4)
    limits = Limits(low, high, join_timeout=60.0, last_call=5.0, grace=DEAD, admission=rules)
    world = World(limits, topologies)
    for skew in first_skews:
        world.spawn(skew)
    play(world, ops)
    settle(world)
    _check_rounds(world, rules)
    state, _ = world.read()
    records = []
    if state is not None:
        records = [decode_record(r) for r in world.backend.queue_records(state.next_round)]
    for node in world.nodes:
        if node.crashed or node.done:
            continue
        assert state is not None
        if node.progress is not None:
            live = state.live_count
            room = live < limits.max_nodes and grows(
                live, len(records), records, limits.min_nodes, limits.max_nodes, rules
            )
            assert not room or len(records) < limits.min_nodes, "a live node is stuck"
        elif not state.closed:
            assert node.round == state.round, "a live node runs an old round"


@pytest.mark.parametrize("keep", [True, False])
def test_in_the_simulation_a_spare_takes_a_crashed_members_slot(keep: bool) -> None:
    rules = Admission(keep_ranks=keep)
    limits = Limits(4, 4, join_timeout=60.0, last_call=5.0, grace=DEAD, admission=rules)
    world = World(limits)
    for _ in range(5):
        world.spawn(0.0)
    settle(world)
    state, _ = world.read()
    assert state is not None
    first = state.participants
    (spare,) = [n.key for n in world.nodes if n.key not in first]
    victim = next(n for n in world.nodes if n.key == first[1])
    victim.crashed = True
    settle(world)
    state, _ = world.read()
    assert state is not None
    assert state.round == 1
    expected = (first[0], spare, *first[2:]) if keep else (first[0], *first[2:], spare)
    assert state.participants == expected
    _check_rounds(world, rules)


def test_a_seal_under_rules_waits_for_the_member_that_left_to_re_join() -> None:
    state = RendezvousState(0, tuple(N[:2])).evict([N[1]])  # N[1] left to re-join
    queue = _records([N[8], N[9], N[0]])
    limits = _limits(2, 2, keep_ranks=True)
    assert missing_members(state, queue, N[1]) == [N[1]]
    assert plan_seal(state, 1, queue, limits, N[1]) is None
    plan = plan_seal(state, 1, [*queue, JoinRecord(N[1])], limits, N[1])
    assert plan is not None
    assert plan.participants == (N[0], N[1])
    # Without a leaver (none named, or judged dead and left out) the spare takes the place.
    plan = plan_seal(state, 1, queue, limits)
    assert plan is not None
    assert plan.participants == (N[0], N[8])
