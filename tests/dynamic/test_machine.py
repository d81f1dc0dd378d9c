"""Every branch of the sans-I/O machine, driven with a fake clock."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rdzv.backends.base import GONE_MARK
from rdzv.dynamic.judging import GONE_GRACE, judge_marks
from rdzv.dynamic.machine import (
    Complete,
    Enqueue,
    Fail,
    FailReason,
    JoinProgress,
    Limits,
    Requeue,
    Seal,
    Wait,
    backup_delay,
    decide,
    last_call_left,
    newcomers,
    nodes_waiting,
    observe,
    plan_seal,
    start_join,
)
from rdzv.dynamic.state import JoinRecord, RendezvousState, StateSummary, make_node_key
from rdzv.testing import FakeClock

LIMITS = Limits(min_nodes=2, max_nodes=4, join_timeout=100.0, last_call=10.0, grace=6.0)
ME = make_node_key("10.0.0.1", 1, "me")
A, B, C, D, E = (make_node_key(f"10.0.0.{i}", 1, "x") for i in range(2, 7))


def _joined(position: int, clock: FakeClock, state: RendezvousState | None = None) -> JoinProgress:
    progress = replace(start_join(state, clock()), position=position)
    return observe(progress, state, position, LIMITS, clock())


def test_start_join_targets_the_round_after_the_last_sealed() -> None:
    assert start_join(None, 5.0).round_id == 0
    assert start_join(RendezvousState(3, (A,)), 5.0).round_id == 4


def test_first_action_is_enqueue() -> None:
    clock = FakeClock()
    progress = start_join(None, clock())
    assert decide(progress, None, 0, ME, LIMITS, clock()) == Enqueue(0)


def test_closed_run_fails_closed_for_a_joiner() -> None:
    clock = FakeClock()
    closed = RendezvousState(0, (A, B)).close()
    progress = start_join(closed, clock())
    assert decide(progress, closed, 0, ME, LIMITS, clock()) == Fail(FailReason.CLOSED)


def test_closed_run_lets_spares_exit_gracefully() -> None:
    clock = FakeClock()
    full = RendezvousState(0, (A, B, C, D))
    progress = _joined(1, clock, full)
    assert decide(progress, full.close(), 1, ME, LIMITS, clock()) == Fail(FailReason.GRACEFUL_EXIT)
    beyond_max = _joined(5, clock)
    assert decide(beyond_max, RendezvousState().close(), 5, ME, LIMITS, clock()) == Fail(
        FailReason.GRACEFUL_EXIT
    )


def test_member_of_the_sealed_round_completes_although_the_run_closed_after() -> None:
    clock = FakeClock()
    progress = _joined(2, clock)
    closed = RendezvousState(0, (A, ME)).close()
    assert decide(progress, closed, 2, ME, LIMITS, clock()) == Complete(1)
    later = replace(progress, round_id=1)
    assert decide(later, closed, 2, ME, LIMITS, clock()) == Fail(FailReason.CLOSED)


def test_sealed_round_with_me_completes_with_my_rank() -> None:
    clock = FakeClock()
    progress = _joined(2, clock)
    sealed = RendezvousState(0, (A, ME, B))
    assert decide(progress, sealed, 3, ME, LIMITS, clock()) == Complete(1)


def test_sealed_round_without_me_requeues_for_the_next() -> None:
    clock = FakeClock()
    progress = _joined(3, clock)
    assert decide(progress, RendezvousState(0, (A, B)), 3, ME, LIMITS, clock()) == Requeue(1)
    evicted = RendezvousState(0, (A, ME)).evict([ME])
    assert decide(progress, evicted, 3, ME, LIMITS, clock()) == Requeue(1)


def test_a_state_that_went_back_requeues_into_the_stored_round() -> None:
    clock = FakeClock()
    progress = _joined(1, clock, RendezvousState(6, (A, B)))  # waits in the queue of round 7
    assert decide(progress, None, 0, ME, LIMITS, clock()) == Requeue(0)  # the store restarted empty
    older = RendezvousState(2, (A, B))  # the store was restored from an older copy
    assert decide(progress, older, 0, ME, LIMITS, clock()) == Requeue(3)
    unchanged = RendezvousState(6, (A, B))
    assert decide(progress, unchanged, 1, ME, LIMITS, clock()) == Wait(progress.started_at + 100.0)


def test_below_min_waits_until_the_join_deadline_then_is_exhausted() -> None:
    clock = FakeClock()
    progress = _joined(1, clock)
    action = decide(progress, None, 1, ME, LIMITS, clock())
    assert action == Wait(progress.started_at + 100.0)
    clock.advance(100.0)
    assert decide(progress, None, 1, ME, LIMITS, clock()) == Fail(FailReason.EXHAUSTED)


def test_join_deadline_with_min_reached_is_a_timeout() -> None:
    clock = FakeClock()
    progress = _joined(3, clock)
    clock.advance(100.0)
    progress = observe(progress, None, 3, LIMITS, clock())
    assert decide(progress, None, 3, ME, LIMITS, clock()) == Fail(FailReason.TIMEOUT)


def test_max_leader_seals_at_once() -> None:
    clock = FakeClock()
    progress = _joined(4, clock)
    assert decide(progress, None, 4, ME, LIMITS, clock()) == Seal()


@pytest.mark.parametrize(("position", "tiers"), [(3, 1), (2, 2), (1, 2)])
def test_others_back_up_the_max_leader_in_tiers_of_grace(position: int, tiers: int) -> None:
    """The next position backs up the leader after grace; farther ones a grace per doubling."""
    clock = FakeClock()
    progress = _joined(position, clock)
    progress = observe(progress, None, 4, LIMITS, clock())
    due = clock() + tiers * 6.0
    assert decide(progress, None, 4, ME, LIMITS, clock()) == Wait(due)
    clock.advance(due - clock() - 0.01)
    assert isinstance(decide(progress, None, 4, ME, LIMITS, clock()), Wait)
    clock.advance(0.01)
    assert decide(progress, None, 4, ME, LIMITS, clock()) == Seal()


def test_backups_act_in_tiers_that_at_most_double() -> None:
    """Of 2,048 nodes, a slow leader is backed up by 1, then 2, 4, ... more, a grace apart."""
    delays = [backup_delay(p, 2048, 3.0) for p in range(1, 2049)]
    assert delays[-1] == 0.0
    tiers = sorted(set(delays) - {0.0})
    assert tiers == [3.0 * k for k in range(1, 12)]
    assert [delays.count(t) for t in tiers] == [2**k for k in range(11)]


def test_min_leader_runs_the_last_call_on_its_own_clock() -> None:
    clock = FakeClock()
    progress = _joined(2, clock)
    assert decide(progress, None, 2, ME, LIMITS, clock()) == Wait(clock() + 10.0)
    clock.advance(9.9)
    assert isinstance(decide(progress, None, 3, ME, LIMITS, clock()), Wait)
    clock.advance(0.1)
    assert decide(progress, None, 3, ME, LIMITS, clock()) == Seal()


def test_others_back_up_the_last_call_after_grace() -> None:
    clock = FakeClock()
    progress = _joined(3, clock)
    assert decide(progress, None, 3, ME, LIMITS, clock()) == Wait(clock() + 16.0)
    clock.advance(16.0)
    assert decide(progress, None, 3, ME, LIMITS, clock()) == Seal()


def test_a_re_formation_whose_live_members_are_all_queued_seals_without_a_last_call() -> None:
    """Members of round 3 (C evicted) re-join: the min leader seals at once, backups later."""
    clock = FakeClock()
    failed = RendezvousState(3, (A, B, C)).evict([C])
    leader = _joined(2, clock, failed)
    assert decide(leader, failed, 2, ME, LIMITS, clock()) == Seal(reform=True)
    backup = observe(_joined(1, clock, failed), failed, 2, LIMITS, clock())
    assert decide(backup, failed, 2, ME, LIMITS, clock()) == Wait(clock() + 6.0)
    clock.advance(6.0)
    assert decide(backup, failed, 2, ME, LIMITS, clock()) == Seal(reform=True)
    # Once the last call is over it is an ordinary seal, newcomers or not.
    clock.advance(10.0)
    assert decide(backup, failed, 2, ME, LIMITS, clock()) == Seal()


def test_a_re_formation_waits_the_last_call_while_a_live_member_may_still_come() -> None:
    clock = FakeClock()
    failed = RendezvousState(3, (A, B, C))  # three live members, two queued
    leader = _joined(2, clock, failed)
    assert decide(leader, failed, 2, ME, LIMITS, clock()) == Wait(clock() + 10.0)
    # The third re-joins: nothing is missing any more.
    assert decide(leader, failed, 3, ME, LIMITS, clock()) == Seal(reform=True)


@pytest.mark.parametrize(
    "state", [None, RendezvousState(3, (A, B)).evict([A, B]), StateSummary(3, False, 0)]
)
def test_a_first_formation_or_one_after_every_member_died_waits_the_last_call(
    state: RendezvousState | StateSummary | None,
) -> None:
    clock = FakeClock()
    leader = _joined(2, clock, state if isinstance(state, RendezvousState) else None)
    if state is not None:
        leader = replace(leader, round_id=4)
    assert decide(leader, state, 2, ME, LIMITS, clock()) == Wait(clock() + 10.0)


def test_a_re_formation_with_a_newcomer_in_its_queue_waits_the_last_call() -> None:
    clock = FakeClock()
    failed = RendezvousState(3, (A, B, C)).evict([C])
    assert not newcomers(failed, [JoinRecord(B), JoinRecord(A), JoinRecord(C)])
    assert newcomers(failed, [JoinRecord(A), JoinRecord(D)])
    # The leader's seal found D in the queue (rdzv.dynamic.join): no seal before the last call.
    leader = replace(_joined(2, clock, failed), newcomers=True)
    assert decide(leader, failed, 2, ME, LIMITS, clock()) == Wait(clock() + 10.0)
    clock.advance(10.0)
    assert decide(leader, failed, 2, ME, LIMITS, clock()) == Seal()


def test_a_summary_decides_a_re_formation_as_its_state() -> None:
    clock = FakeClock()
    failed = RendezvousState(3, (A, B, C)).evict([C])
    leader = _joined(2, clock, failed)
    summary = StateSummary.of(failed)
    assert decide(leader, summary, 2, ME, LIMITS, clock()) == Seal(reform=True)


def test_the_last_call_left_is_the_leaders_countdown_and_none_outside_one() -> None:
    clock = FakeClock()
    leader = _joined(2, clock)
    assert last_call_left(leader, None, 1, LIMITS, clock()) is None  # below min
    assert last_call_left(leader, None, 4, LIMITS, clock()) is None  # full: sealed at once
    clock.advance(4.0)
    assert last_call_left(leader, None, 2, LIMITS, clock()) == pytest.approx(6.0)
    failed = RendezvousState(3, (A, B, C)).evict([C])
    assert last_call_left(_joined(2, clock, failed), failed, 2, LIMITS, clock()) is None


def test_last_call_wait_never_passes_the_join_deadline() -> None:
    clock = FakeClock()
    tight = replace(LIMITS, join_timeout=5.0)
    progress = replace(start_join(None, clock()), position=2)
    progress = observe(progress, None, 2, tight, clock())
    assert decide(progress, None, 2, ME, tight, clock()) == Wait(clock() + 5.0)


def test_spare_beyond_max_waits_then_seals_only_if_the_admitted_stall() -> None:
    clock = FakeClock()
    progress = _joined(5, clock)
    stalled = progress.started_at + 10.0 + 2 * 6.0  # last call + twice the backups' grace
    assert decide(progress, None, 5, ME, LIMITS, clock()) == Wait(stalled)
    clock.advance(stalled - clock() - 0.01)
    assert decide(progress, None, 5, ME, LIMITS, clock()) == Wait(stalled)
    clock.advance(0.01)
    assert decide(progress, None, 5, ME, LIMITS, clock()) == Seal()
    # A refused seal (members of the last round missing) waits on the queue.
    blocked = replace(progress, blocked=(5, None))
    assert decide(blocked, None, 5, ME, LIMITS, clock()) == Wait(
        progress.started_at + 100.0, on_queue=True
    )


def test_spare_behind_a_full_round_never_times_out() -> None:
    clock = FakeClock()
    full = RendezvousState(0, (A, B, C, D))
    progress = _joined(1, clock, full)
    clock.advance(1000.0)
    progress = observe(progress, full, 1, LIMITS, clock())
    assert isinstance(decide(progress, full, 1, ME, LIMITS, clock()), Wait)
    assert progress.started_at == clock()


def test_refused_seal_waits_on_the_queue_until_something_changes() -> None:
    clock = FakeClock()
    progress = _joined(4, clock)
    progress = replace(progress, blocked=(4, None))
    assert decide(progress, None, 4, ME, LIMITS, clock()) == Wait(
        progress.started_at + 100.0, on_queue=True
    )
    assert decide(progress, None, 5, ME, LIMITS, clock()) == Seal()


def test_plan_seal_needs_min_distinct_nodes() -> None:
    assert plan_seal(None, 0, [JoinRecord(A), JoinRecord(A)], LIMITS) is None
    planned = plan_seal(None, 0, [JoinRecord(A), JoinRecord(B)], LIMITS)
    assert planned == RendezvousState(0, (A, B))


def test_plan_seal_waits_for_every_live_previous_member() -> None:
    previous = RendezvousState(3, (A, B, C))
    assert plan_seal(previous, 4, [JoinRecord(A), JoinRecord(D)], LIMITS) is None
    after_eviction = previous.evict([B, C])
    assert plan_seal(after_eviction, 4, [JoinRecord(D), JoinRecord(A)], LIMITS) == (
        RendezvousState(4, (A, D))
    )


def test_plan_seal_admits_at_most_max() -> None:
    records = [JoinRecord(n) for n in (A, B, C, D, E)]
    planned = plan_seal(None, 0, records, LIMITS)
    assert planned is not None
    assert planned.participants == (A, B, C, D)


@pytest.mark.parametrize(
    ("state", "queued", "expected"),
    [
        (None, 3, 3),
        (RendezvousState(0, (ME, A)), 0, 0),
        (RendezvousState(0, (ME, A)), 2, 2),
        (RendezvousState(0, (ME, A, B, C)), 2, 0),  # full: spares do not count
        (RendezvousState(0, (ME, A, B, C)).evict([B]), 0, 1),  # a dead member counts
        (RendezvousState(0, (ME, A)).evict([ME]), 0, 1),  # I was evicted: re-join
        (RendezvousState(1, (A, B)), 0, 1),  # a newer round without me
    ],
)
def test_nodes_waiting(state: RendezvousState | None, queued: int, expected: int) -> None:
    assert nodes_waiting(state, queued, ME, LIMITS) == expected


def test_judge_marks_uses_only_the_observers_clock() -> None:

    clock = FakeClock(start=-5000.0)  # any origin: only differences matter
    watches, dead = judge_marks({}, {A: b"1", B: None}, clock(), 3.0)
    assert dead == []
    clock.advance(2.5)
    watches, dead = judge_marks(watches, {A: b"2", B: None}, clock(), 3.0)
    assert dead == []
    clock.advance(0.5)
    watches, dead = judge_marks(watches, {A: b"2", B: None}, clock(), 3.0)
    assert dead == [B]  # B never beat for 3 s of the observer's clock
    assert A in watches
    assert B not in watches
    clock.advance(2.0)
    watches, dead = judge_marks(watches, {A: b"2"}, clock(), 3.0)
    assert dead == []  # A changed 2.5 s ago
    clock.advance(0.5)
    _, dead = judge_marks(watches, {A: b"2"}, clock(), 3.0)
    assert dead == [A]


def test_a_mark_that_says_the_process_died_is_judged_after_a_short_grace() -> None:
    """A will wrote GONE_MARK: dead after GONE_GRACE, not the 15 s dead-node timeout."""
    clock = FakeClock()
    watches, dead = judge_marks({}, {A: b"3", B: b"3"}, clock(), 15.0)
    watches, dead = judge_marks(watches, {A: GONE_MARK, B: GONE_MARK}, clock(), 15.0)
    assert dead == []
    clock.advance(GONE_GRACE / 2)
    # B's living process wrote a fresh mark within the grace (its connection was reset).
    watches, dead = judge_marks(watches, {A: GONE_MARK, B: b"1"}, clock(), 15.0)
    assert dead == []
    clock.advance(GONE_GRACE / 2)
    watches, dead = judge_marks(watches, {A: GONE_MARK, B: b"1"}, clock(), 15.0)
    assert dead == [A]
    assert set(watches) == {B}
    # Never later than the dead-node timeout, when that is the shorter.
    watches, dead = judge_marks({}, {C: GONE_MARK}, clock(), 0.3)
    clock.advance(0.2)
    watches, dead = judge_marks(watches, {C: GONE_MARK}, clock(), 0.3)
    assert dead == []
    clock.advance(0.2)
    assert judge_marks(watches, {C: GONE_MARK}, clock(), 0.3)[1] == [C]


def test_judge_marks_credits_at_most_max_gap_between_readings() -> None:

    clock = FakeClock()
    watches, _ = judge_marks({}, {A: b"1"}, clock(), 3.0, max_gap=1.0)
    clock.advance(6.0)  # the store was paused: no reading could happen
    watches, dead = judge_marks(watches, {A: b"1"}, clock(), 3.0, max_gap=1.0)
    assert dead == []  # only 1 s of the 6 s is charged
    for _ in range(3):  # readings every 0.5 s afterwards: 1 + 4 x 0.5 = 3 s charged at the end
        clock.advance(0.5)
        watches, dead = judge_marks(watches, {A: b"1"}, clock(), 3.0, max_gap=1.0)
        assert dead == []
    clock.advance(0.5)
    _, dead = judge_marks(watches, {A: b"1"}, clock(), 3.0, max_gap=1.0)
    assert dead == [A]


def test_judge_marks_without_a_gap_bound_charges_all_time() -> None:

    clock = FakeClock()
    watches, _ = judge_marks({}, {A: b"1"}, clock(), 3.0)
    clock.advance(6.0)
    _, dead = judge_marks(watches, {A: b"1"}, clock(), 3.0)
    assert dead == [A]


def test_successor_ring_skips_evicted_members() -> None:
    from rdzv.dynamic.machine import successor_of

    state = RendezvousState(0, (A, B, C))
    assert successor_of(state, A) == B
    assert successor_of(state, C) == A
    assert successor_of(state.evict([B]), A) == C
    assert successor_of(state.evict([B, C]), A) is None
    assert successor_of(state, ME) is None


def test_missing_members() -> None:
    from rdzv.dynamic.machine import missing_members

    state = RendezvousState(0, (A, B, C)).evict([C])
    assert missing_members(None, [JoinRecord(A)]) == []
    assert missing_members(state, [JoinRecord(A), JoinRecord(D)]) == [B]


def test_leaders_judge_missing_members_often_others_only_once_the_seal_stalled() -> None:
    from rdzv.dynamic.judging import SealJudging, judge_interval

    interval = 2.0  # LIMITS.grace is the dead-node timeout: 6 s
    every = judge_interval(interval, LIMITS.grace)
    assert every == pytest.approx(0.15)
    leader, other = SealJudging(), SealJudging()
    due, leader = leader.due(LIMITS.min_nodes, LIMITS, 0.0, interval)
    assert due
    due, leader = leader.due(LIMITS.min_nodes, LIMITS, 0.1, interval)
    assert not due  # not before its cadence
    due, leader = leader.due(LIMITS.min_nodes, LIMITS, 0.15, interval)
    assert due
    due, other = other.due(3, LIMITS, 0.0, interval)
    assert not due
    due, other = other.due(3, LIMITS, 11.9, interval)
    assert not due  # stalled only after two dead-node timeouts
    due, other = other.due(3, LIMITS, 12.0, interval)
    assert due
    due, other = other.due(3, LIMITS, 13.0, interval)
    assert not due  # then once per heartbeat interval
    due, other = other.due(None, LIMITS, 14.0, interval)
    assert due


@pytest.mark.parametrize(
    ("position", "starts_after_graces"),
    [(5, 2), (6, 3), (7, 3), (8, 4), (11, 4), (12, 5), (36, 7), (1, 2), (3, 2)],
)
def test_others_judge_a_stalled_seal_in_tiers_doubling_each_dead_node_timeout(
    position: int, starts_after_graces: int
) -> None:
    from rdzv.dynamic.judging import SealJudging

    start = starts_after_graces * LIMITS.grace
    judging = SealJudging()
    due, judging = judging.due(position, LIMITS, 0.0, 1.0)
    assert not due
    due, judging = judging.due(position, LIMITS, start - 0.01, 1.0)
    assert not due
    due, judging = judging.due(position, LIMITS, start, 1.0)
    assert due


def test_judge_interval_bounds() -> None:
    from rdzv.dynamic.judging import judge_interval

    assert judge_interval(5.0, 15.0) == pytest.approx(0.375)
    assert judge_interval(0.1, 0.3) == pytest.approx(0.02)  # never more often than 20 ms
    assert judge_interval(1.0, 1000.0) == 1.0  # never less often than a beat


def test_round_lost() -> None:
    from rdzv.dynamic.machine import round_lost

    mine = 3
    assert not round_lost(mine, RendezvousState(3, (ME, A), evicted=frozenset({1})))
    assert round_lost(mine, None)  # wiped
    assert round_lost(mine, RendezvousState(2, (ME, A)))  # went back
    assert round_lost(mine, RendezvousState(900, (ME, A)))  # a round it never joined


def test_bootstrap_abandoned() -> None:
    from rdzv.dynamic.machine import bootstrap_abandoned

    sealed = RendezvousState(3, (A, ME))
    assert not bootstrap_abandoned(sealed, sealed)
    assert not bootstrap_abandoned(sealed, sealed.evict([ME]))
    assert bootstrap_abandoned(sealed, sealed.evict([A]))  # rank 0 left
    assert bootstrap_abandoned(sealed, sealed.close())
    assert bootstrap_abandoned(sealed, RendezvousState(4, (A, ME)))
    assert bootstrap_abandoned(sealed, None)


def test_droppable_queue_keeps_the_previous_one() -> None:
    from rdzv.dynamic.machine import droppable_queue

    assert droppable_queue(0) is None
    assert droppable_queue(1) is None
    assert droppable_queue(2) == 0
    assert droppable_queue(9) == 7


def test_leaving_members() -> None:
    from rdzv.dynamic.machine import leaving_members

    state = RendezvousState(3, (ME, A, B))
    assert leaving_members(state, 3, [ME, C], False) == [ME]
    assert leaving_members(state, 2, [ME], False) == []  # another round
    assert leaving_members(state.close(), 3, [ME], False) == []
    some_gone = state.evict([B])
    assert leaving_members(some_gone, 3, [ME], True) == []  # the others re-form anyway
    assert leaving_members(some_gone, 3, [ME], False) == [ME]


def test_a_large_ring_reads_marks_less_often_within_one_interval() -> None:
    from rdzv.dynamic.pacing import RING_READS_PER_SECOND, ring_judge_period

    assert ring_judge_period(0.075, 1.0, 128) == pytest.approx(0.075)
    at_1024 = ring_judge_period(0.075, 1.0, 1024)
    assert 1024 / at_1024 == pytest.approx(RING_READS_PER_SECOND)
    assert ring_judge_period(0.075, 1.0, 8192) == pytest.approx(1.0)


@pytest.mark.parametrize("waiting", [1, 100, 1000, 2048, 8192, 100_000])
def test_nodes_waiting_for_a_seal_poll_the_queue_within_the_budget(waiting: int) -> None:
    from rdzv.dynamic.pacing import QUEUE_POLLS_PER_SECOND, state_wait_cap

    cap = state_wait_cap(waiting)
    assert cap >= 1.0  # a small queue is read once a second, for backups and progress
    assert waiting / cap <= QUEUE_POLLS_PER_SECOND * (1 + 1e-9)
    assert cap <= max(1.0, waiting / QUEUE_POLLS_PER_SECOND) * (1 + 1e-9)  # never slower


_NODES = tuple(make_node_key(f"10.1.0.{i}", 1, "p") for i in range(1, 9))


def _state_of(round_: int, size: int, evicted: int, closed: bool, me_at: int) -> RendezvousState:
    """A state; this node (ME) is its participant at ``me_at`` if that is a rank."""
    if round_ < 0:
        return RendezvousState(closed=closed)
    nodes = list(_NODES[:size])
    if me_at < size:
        nodes[me_at] = ME
    return RendezvousState(
        round_,
        tuple(nodes),
        evicted=frozenset(range(min(evicted, size))),
        closed=closed,
    )


@settings(max_examples=600, deadline=None)
@given(
    fields=st.tuples(
        st.integers(-1, 3), st.integers(1, 8), st.integers(0, 8), st.booleans(), st.integers(0, 9)
    ),
    round_id=st.integers(0, 4),
    position=st.one_of(st.none(), st.integers(1, 8)),
    queue=st.integers(0, 8),
    seen=st.tuples(st.one_of(st.none(), st.floats(0, 50)), st.one_of(st.none(), st.floats(0, 50))),
    now=st.floats(0, 200),
    limits=st.builds(
        Limits,
        min_nodes=st.integers(1, 3),
        max_nodes=st.integers(3, 6),
        join_timeout=st.just(100.0),
        last_call=st.just(10.0),
        grace=st.just(6.0),
    ),
)
def test_a_state_s_summary_decides_as_the_state_until_the_round_joined_is_sealed(
    fields: tuple[int, int, int, bool, int],
    round_id: int,
    position: int | None,
    queue: int,
    seen: tuple[float | None, float | None],
    now: float,
    limits: Limits,
) -> None:
    """Any state of any round, closed or not, with this node in it or not:
    while the round joined is not sealed, a join observes and decides the same
    on the state's summary (rdzv.dynamic.handler reads summaries then)."""
    state = _state_of(*fields)
    summary = StateSummary.of(state)
    progress = JoinProgress(round_id, 0.0, position, seen[0], seen[1])
    assert start_join(summary, now) == start_join(state, now)
    on_state = observe(progress, state, queue, limits, now)
    assert observe(progress, summary, queue, limits, now) == on_state
    if state.round == round_id:
        with pytest.raises(ValueError, match="cannot tell"):
            decide(on_state, summary, queue, ME, limits, now)
        return
    assert decide(on_state, summary, queue, ME, limits, now) == decide(
        on_state, state, queue, ME, limits, now
    )
