"""The confirmation of a sealed round (rdzv.dynamic.confirm)."""

from __future__ import annotations

import threading

import pytest

from rdzv.backends.kv import StoreJoinQueue, StoreVerdict
from rdzv.dynamic.confirm import (
    CHECKS_PER_SECOND,
    RoundConfirmation,
    check_period,
    member_lost,
)
from rdzv.dynamic.state import RendezvousState
from rdzv.keys import verdict_key
from rdzv.store.base import Store
from rdzv.store.memory import HashStore

SEALED = RendezvousState(4, ("a", "b", "c"))


def _verdicts(store: Store, prefix: str = "run/") -> StoreVerdict:
    """The verdicts of a run whose state is never written while they wait."""
    return StoreVerdict(store, prefix, lambda token: False, 1.0)


def _confirmation(
    store: HashStore, sealed: RendezvousState = SEALED, prefix: str = "run/"
) -> RoundConfirmation:
    return RoundConfirmation(
        StoreJoinQueue(store, prefix, "c"),
        _verdicts(store, prefix),
        sealed.round,
        len(sealed.participants),
        lambda: sealed.participants,
    )


def test_the_member_that_completes_the_count_writes_the_verdict() -> None:
    store = HashStore(timeout=5)
    confirmation = _confirmation(store)
    confirmation.confirm("a")
    confirmation.confirm("b")
    assert not confirmation.wait(0.01)
    assert confirmation.unconfirmed() == ["c"]
    confirmation.confirm("c")
    assert confirmation.wait(0.01)
    assert confirmation.unconfirmed() == []


def test_a_member_counted_twice_does_not_stand_in_for_a_missing_one() -> None:
    # An append retried after a lost reply lands twice: the count reaches the
    # world size while c never confirmed.
    store = HashStore(timeout=5)
    confirmation = _confirmation(store)
    for node in ("a", "b", "b"):
        confirmation.confirm(node)
    assert not confirmation.wait(0.01)
    confirmation.confirm("c")  # position 4: the count is past the world size
    assert confirmation.wait(0.01)


def test_a_waiting_member_wakes_when_the_last_one_confirms() -> None:
    store = HashStore(timeout=5)
    sealed = RendezvousState(0, ("a", "b"))
    first, last = _confirmation(store, sealed), _confirmation(store, sealed)
    first.confirm("a")
    timer = threading.Timer(0.05, last.confirm, args=("b",))
    timer.start()
    try:
        assert first.wait(30)  # a generous bound: returns at the confirmation
    finally:
        timer.cancel()


def test_rounds_and_runs_do_not_share_confirmations() -> None:
    store = HashStore(timeout=5)
    _confirmation(store, RendezvousState(1, ("a",))).confirm("a")
    assert not _confirmation(store, RendezvousState(2, ("a",))).wait(0.01)
    assert not _confirmation(store, RendezvousState(1, ("a",)), "other/").wait(0.01)


def test_confirmations_are_not_join_records() -> None:
    store = HashStore(timeout=5)
    joins = StoreJoinQueue(store, "run/")
    _confirmation(store).confirm("a")
    assert joins.queue_length(SEALED.round) == 0
    assert joins.confirmation_queue().queue_length(SEALED.round) == 1


def test_dropping_a_round_deletes_its_confirmations_only() -> None:
    store = HashStore(timeout=5)
    old, kept = (_confirmation(store, RendezvousState(r, ("a",))) for r in (1, 3))
    old.confirm("a")
    kept.confirm("a")
    assert store.check([verdict_key("run/", 1)])
    old.queue.drop_queue(1)
    old.verdicts.drop_verdict(1)
    assert not store.check([verdict_key("run/", 1)])
    assert old.queue.queue_length(1) == 0
    assert kept.wait(0.01)
    assert kept.queue.queue_length(3) == 1


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
    assert member_lost(SEALED.round, len(SEALED.participants), stored) is lost


@pytest.mark.parametrize("world_size", [2, 100, 500, 2_000, 8_192, 100_000])
@pytest.mark.parametrize("dead_after", [0.3, 0.9, 3.0, 15.0])
def test_waiting_members_check_within_the_budget(world_size: int, dead_after: float) -> None:
    period = check_period(world_size, dead_after)
    assert period >= 0.25
    assert period <= max(1.0, dead_after / 4)  # a lost member is noticed soon after its eviction
    assert period >= min(1.0, world_size / CHECKS_PER_SECOND)  # the round's checks stay in budget
    assert period >= dead_after / 4  # no check before an eviction could have come


def test_a_slice_without_the_verdict_is_one_request_on_a_store_that_watches() -> None:
    # At 8,192 members the first confirm seconds before the last: each slice
    # they wait costs one request (the server ends it), not a WAIT and its
    # CANCEL_WAIT.
    from rdzv.store.server import TCPStoreServer
    from rdzv.store.tcp import TCPStore

    with (
        TCPStoreServer("127.0.0.1", 0) as server,
        TCPStore("127.0.0.1", server.port, timeout=5) as store,
    ):
        assert store.supports_watch
        confirmation = RoundConfirmation(
            StoreJoinQueue(store, "run/", "c"), _verdicts(store), 4, 2, lambda: ("a", "b")
        )
        confirmation.confirm("a")
        before = server.requests
        assert not confirmation.wait(0.1)
        assert server.requests - before == 1
        confirmation.confirm("b")
        assert confirmation.wait(0.1)


def test_a_wait_in_the_store_ends_at_a_write_of_the_state() -> None:
    # Between its slices the wait looks at the state's token: a write (an
    # eviction) ends it as an engine's joint wait, before its timeout.
    store = HashStore(timeout=5)
    looked: list[object] = []

    def changed(token: object) -> bool:
        looked.append(token)
        return len(looked) == 3

    confirmation = RoundConfirmation(
        StoreJoinQueue(store, "run/", "c"),
        StoreVerdict(store, "run/", changed, 0.01),
        4,
        2,
        lambda: ("a", "b"),
    )
    confirmation.confirm("a")
    assert confirmation.wait(30, token="t1") is False  # a generous bound: the third slice ends it
    assert looked == ["t1"] * 3
    assert confirmation.wait(0.01, token="t2") is None
    confirmation.confirm("b")
    assert confirmation.wait(30, token="t2") is True
