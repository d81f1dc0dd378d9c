"""The requests an etcd wait or heartbeat sends: one watch for a verdict and the state, events' values used.

At thousands of members every request through etcd's gateway costs etcd
CPU that the round waits for: a read after a watch that already carried
the value, or a lease refresh at every beat of a 60 s lease, doubled them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from rdzv.backends.etcd import EtcdRendezvousBackend
from rdzv.backends.etcd.client import EtcdClientBase
from rdzv.backends.etcd.store import EtcdStore
from rdzv.dynamic.confirm import RoundConfirmation
from rdzv.testing.clock import AutojumpClock

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(60)]


# The client's leaf operations: each is one request to etcd on either client.
_OPERATIONS = ("range", "count", "put", "delete", "txn", "lease_grant", "lease_keepalive", "watch")


@pytest.fixture
def calls(etcd_client: EtcdClientBase, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The client's requests from here on, by operation (a keys-only range says so)."""
    sent: list[str] = []

    def recording(name: str) -> Callable[..., Any]:
        real = getattr(etcd_client, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            sent.append(name + (" keys-only" if kwargs.get("keys_only") else ""))
            return real(*args, **kwargs)

        return call

    for name in _OPERATIONS:
        monkeypatch.setattr(etcd_client, name, recording(name))
    return sent


def _while_watching(calls: list[str], wait: Callable[[], Any], write: Callable[[], Any]) -> Any:
    """Run ``wait`` in a thread; once it watches, ``write``; return what ``wait`` returned."""
    result: list[Any] = []
    waiter = threading.Thread(target=lambda: result.append(wait()))
    waiter.start()
    try:
        deadline = time.monotonic() + 10
        while "watch" not in calls and time.monotonic() < deadline:
            time.sleep(0.005)
        write()
    finally:
        waiter.join(30)
    assert len(result) == 1
    return result[0]


@pytest.mark.parametrize("seen", [True, False])
def test_a_state_waiter_watches_from_its_token_and_reads_the_state_once(
    etcd_client: EtcdClientBase, unique: str, calls: list[str], seen: bool
) -> None:
    writer = EtcdRendezvousBackend(etcd_client, unique, key_prefix="/test/")
    reader = EtcdRendezvousBackend(etcd_client, unique, key_prefix="/test/")
    first = writer.set_state(b"one")
    assert first is not None
    if seen:
        assert reader.get_state() == first[:2]
    calls.clear()
    second: list[Any] = []
    woken = _while_watching(
        calls,
        lambda: reader.wait_for_state(first[1], 10.0),
        lambda: second.append(writer.set_state(b"two", first[1])),
    )
    assert woken == second[0][:2]
    # The state it saw last needs no read before the watch (another token
    # is checked first: its revisions); after the head moved, the state is
    # read with its value, no keys-only read first (the txn is the writer's).
    before = [] if seen else ["range keys-only", "range"]
    assert calls == [*before, "watch", "txn", "range"]
    # A write before the wait ends it at once, with no read before the watch.
    third = writer.set_state(b"three", second[0][1])
    assert third is not None
    calls.clear()
    assert reader.wait_for_state(second[0][1], 10.0) == third[:2]
    assert calls == ["watch", "range"]


@pytest.mark.parametrize("previous", [None, b"old"])
def test_a_store_watch_takes_the_new_value_from_the_event(
    etcd_client: EtcdClientBase, unique: str, calls: list[str], previous: bytes | None
) -> None:
    store = EtcdStore(etcd_client, f"/test/{unique}/")
    if previous is not None:
        store.set("key", previous)
    calls.clear()
    found = _while_watching(
        calls, lambda: store.watch("key", previous, 10.0), lambda: store.set("key", b"new")
    )
    assert found == b"new"
    assert calls == ["range", "watch", "put"]


def test_a_store_get_of_a_key_yet_to_come_takes_its_value_from_the_event(
    etcd_client: EtcdClientBase, unique: str, calls: list[str]
) -> None:
    store = EtcdStore(etcd_client, f"/test/{unique}/", timeout=10)
    found = _while_watching(calls, lambda: store.get("key"), lambda: store.set("key", b"v"))
    assert found == b"v"
    assert calls == ["range", "watch", "put"]


def test_a_beat_refreshes_the_lease_only_a_third_into_its_life(
    etcd_client: EtcdClientBase, unique: str, calls: list[str]
) -> None:
    # On the backend's clock: the refresh is its decision, so no real time passes.
    with AutojumpClock() as clock, clock.running():
        backend = EtcdRendezvousBackend(
            etcd_client, unique, key_prefix="/test/", liveness_ttl=3, clock=clock
        )
        backend.beat("n1")
        marks = [backend.heartbeat_mark("n1")]
        assert calls == ["lease_grant", "put", "range"]
        calls.clear()
        backend.beat("n1")
        marks.append(backend.heartbeat_mark("n1"))
        assert calls == ["put", "range"]  # within a third of 3 s: the put alone
        clock.sleep(1.1)
        calls.clear()
        backend.beat("n1")
        marks.append(backend.heartbeat_mark("n1"))
        assert calls == ["lease_keepalive", "put", "range"]
        assert len(set(marks)) == 3  # every beat moved the mark
        # Beats 0.6 s apart refresh the lease once a third of it passed
        # (at 2.3 s and 3.5 s), so it never reaches its TTL while they go on.
        calls.clear()
        for _ in range(4):
            clock.sleep(0.6)
            backend.beat("n1")
        assert calls == ["put", "lease_keepalive", "put", "put", "lease_keepalive", "put"]
        assert backend.heartbeat_mark("n1") is not None


def test_a_beat_after_the_lease_was_revoked_grants_a_new_one(
    etcd_client: EtcdClientBase, unique: str, calls: list[str]
) -> None:
    backend = EtcdRendezvousBackend(etcd_client, unique, key_prefix="/test/")
    backend.beat("n1")
    lease = backend._node_leases["n1"][0]
    etcd_client.lease_revoke(lease)
    calls.clear()
    backend.beat("n1")  # the put finds no lease: granted anew
    assert calls == ["put", "lease_grant", "put"]
    assert backend._node_leases["n1"][0] != lease
    assert backend.heartbeat_mark("n1") is not None


def test_a_confirmation_waits_for_the_verdict_and_the_state_with_one_watch(
    etcd_client: EtcdClientBase, unique: str, calls: list[str]
) -> None:
    backend = EtcdRendezvousBackend(etcd_client, unique, key_prefix="/test/")
    sealed = backend.set_state(b"sealed")
    assert sealed is not None
    confirms = backend.confirmation_queue()
    a, b = (RoundConfirmation(confirms, confirms, 1, 2, lambda: ("a", "b")) for _ in range(2))
    a.confirm("a")
    calls.clear()
    outcome = _while_watching(calls, lambda: a.wait(10.0, token=sealed[1]), lambda: b.confirm("b"))
    assert outcome is True
    # a's wait is its watch; b enqueues, reads the confirmations, puts the verdict.
    assert calls == ["watch", "txn", "range", "put"]
    # A member that waits after the verdict was put finds it (a watch from a
    # past revision is answered at etcd's next catch-up of such watches).
    assert b.wait(5.0, token=sealed[1]) is True
    # A write of the state (an eviction) ends the wait of a round whose
    # verdict is still to come.
    b.queue.drop_queue(1)
    b.verdicts.drop_verdict(1)
    evicted = backend.set_state(b"evicted", sealed[1])
    assert evicted is not None
    assert a.wait(0.3, token=evicted[1]) is None
    assert a.wait(5.0, token=sealed[1]) is True  # the verdict came before the write
    c = RoundConfirmation(confirms, confirms, 2, 2, lambda: ("a", "b"))
    assert c.wait(5.0, token=sealed[1]) is False


def test_joins_and_confirmations_share_one_lease_and_count_on_a_counter(
    etcd_client: EtcdClientBase, unique: str, calls: list[str]
) -> None:
    backend = EtcdRendezvousBackend(etcd_client, unique, key_prefix="/test/")
    confirms = backend.confirmation_queue()
    assert backend.enqueue(1, b"a") == 1
    assert confirms.enqueue(1, b"a") == 1
    assert backend.enqueue(1, b"b") == 2
    # One lease for the run's keys, the view's writes included; each append
    # one txn that reads its position from the counter's version.
    assert calls == ["lease_grant", "txn", "txn", "txn"]
    assert backend.queue_length(1) == 2
    assert backend.queue_records(1) == [b"a", b"b"]  # the counter is no record
    backend.drop_queue(1)
    assert backend.queue_length(1) == 0
    assert backend.enqueue(1, b"c") == 1  # a dropped queue counts from 1 again
    assert confirms.queue_length(1) == 1


def test_a_wait_ends_on_the_backends_clock(etcd_client: EtcdClientBase, unique: str) -> None:
    # The watch's socket timeout is the time left; that it is over is the
    # clock's, which jumps to the wait's end (a real clock would not have moved).
    with AutojumpClock() as clock:
        backend = EtcdRendezvousBackend(etcd_client, unique, key_prefix="/test/", clock=clock)
        written = backend.set_state(b"one")
        assert written is not None
        begin = clock()
        assert backend.wait_for_verdict(1, written[1], 0.2) is None
        assert backend.wait_queue_length(1, 0, 0.2) == 0
        assert clock() - begin >= 0.4
