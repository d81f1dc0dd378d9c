"""The confirmation of a sealed round (rdzv.dynamic.confirm)."""

from __future__ import annotations

import threading

import pytest

from rdzv.dynamic.confirm import (
    CHECKS_PER_SECOND,
    RoundConfirmation,
    check_period,
    drop_confirmation,
    member_lost,
)
from rdzv.dynamic.state import RendezvousState
from rdzv.store.memory import HashStore

SEALED = RendezvousState(4, ("a", "b", "c"))


def test_the_member_that_completes_the_count_writes_the_verdict() -> None:
    store = HashStore(timeout=5)
    members = [RoundConfirmation(store, "run/", 4, 3) for _ in range(3)]
    members[0].confirm()
    members[1].confirm()
    assert not members[0].wait(0.01)
    assert members[0].confirmed() == 2
    members[2].confirm()
    assert all(m.wait(0.01) for m in members)


def test_a_waiting_member_wakes_when_the_last_one_confirms() -> None:
    store = HashStore(timeout=5)
    first, last = RoundConfirmation(store, "run/", 0, 2), RoundConfirmation(store, "run/", 0, 2)
    first.confirm()
    timer = threading.Timer(0.05, last.confirm)
    timer.start()
    try:
        assert first.wait(30)  # a generous bound: returns at the confirmation
    finally:
        timer.cancel()


def test_rounds_and_runs_do_not_share_confirmations() -> None:
    store = HashStore(timeout=5)
    RoundConfirmation(store, "run/", 1, 1).confirm()
    assert not RoundConfirmation(store, "run/", 2, 1).wait(0.01)
    assert not RoundConfirmation(store, "other/", 1, 1).wait(0.01)


def test_dropping_a_round_deletes_its_keys_only() -> None:
    store = HashStore(timeout=5)
    old, kept = RoundConfirmation(store, "run/", 1, 1), RoundConfirmation(store, "run/", 3, 1)
    old.confirm()
    kept.confirm()
    drop_confirmation(store, "run/", 1)
    assert not store.check([old.count_key])
    assert not store.check([old.verdict_key])
    assert store.check([kept.count_key, kept.verdict_key])


@pytest.mark.parametrize(
    ("stored", "lost"),
    [
        (SEALED, False),
        (RendezvousState(4, ("a", "b", "c"), closed=True), False),  # a close after the seal
        (SEALED.evict(["c"]), True),
        (None, True),  # the store was wiped
        (RendezvousState(5, ("a", "b", "c")), True),
        (RendezvousState(3, ("a", "b", "c")), True),  # the store went back
    ],
)
def test_member_lost(stored: RendezvousState | None, lost: bool) -> None:
    assert member_lost(SEALED, stored) is lost


@pytest.mark.parametrize("world_size", [2, 100, 500, 2_000, 8_192, 100_000])
def test_waiting_members_check_within_the_budget(world_size: int) -> None:
    period = check_period(world_size)
    assert 0.25 <= period <= 1.0  # a lost member is noticed within a second
    if world_size > 2 * CHECKS_PER_SECOND:
        assert period == 1.0
    else:
        assert world_size / period <= CHECKS_PER_SECOND
