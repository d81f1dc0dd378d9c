"""One Store suite, run against every store and every server/client pairing."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import pytest

from rdzv.errors import RendezvousConnectionError, StoreTimeoutError
from rdzv.store.base import Store
from tests.store.conftest import StoreFactory

pytestmark = pytest.mark.timeout(60)


def later(delay: float, action: Callable[[], object]) -> threading.Thread:
    """Run ``action`` in a thread after ``delay`` seconds; the caller joins it."""

    def run() -> None:
        time.sleep(delay)
        action()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_set_get_str_and_bytes(store: Store, uid: str) -> None:
    store.set(f"{uid}/s", "text é")
    store.set(f"{uid}/b", b"\x00\xffraw")
    assert store.get(f"{uid}/s") == "text é".encode()
    assert store.get(f"{uid}/b") == b"\x00\xffraw"
    store.set(f"{uid}/s", "")
    assert store.get(f"{uid}/s") == b""


def test_get_missing_times_out_then_store_still_works(store: Store, uid: str) -> None:
    store.set_timeout(timedelta(milliseconds=300))
    assert store.timeout == timedelta(milliseconds=300)
    with pytest.raises(StoreTimeoutError):
        store.get(f"{uid}/missing")
    store.set(f"{uid}/after", "ok")
    assert store.get(f"{uid}/after") == b"ok"


def test_get_waits_for_a_set_by_another_client(store_factory: StoreFactory, uid: str) -> None:
    reader, writer = store_factory(), store_factory()
    thread = later(0.2, lambda: writer.set(f"{uid}/late", "here"))
    try:
        assert reader.get(f"{uid}/late") == b"here"
    finally:
        thread.join()


def test_add(store: Store, uid: str) -> None:
    assert store.add(f"{uid}/n", 5) == 5
    assert store.add(f"{uid}/n", -7) == -2
    assert store.add(f"{uid}/n", 0) == -2
    assert store.get(f"{uid}/n") == b"-2"
    store.set(f"{uid}/m", "40")
    assert store.add(f"{uid}/m", 2) == 42


def test_add_to_a_non_integer_fails(store: Store, uid: str) -> None:
    store.set(f"{uid}/word", "abc")
    # In memory: ValueError; over TCP both servers drop the connection, as torch's does.
    with pytest.raises((ValueError, RendezvousConnectionError, RuntimeError)):
        store.add(f"{uid}/word", 1)


def test_compare_set_rules(store: Store, uid: str) -> None:
    key = f"{uid}/cas"
    # Missing key, non-empty expected: nothing written, expected returned.
    assert store.compare_set(key, "old", "new") == b"old"
    assert not store.check([key])
    # Missing key, empty expected: created with desired.
    assert store.compare_set(key, "", "first") == b"first"
    assert store.get(key) == b"first"
    # Mismatch: unchanged, current value returned.
    assert store.compare_set(key, "wrong", "second") == b"first"
    assert store.get(key) == b"first"
    # Match: swapped.
    assert store.compare_set(key, "first", b"second") == b"second"
    assert store.get(key) == b"second"
    # Present key, empty expected: a mismatch like any other.
    assert store.compare_set(key, "", "third") == b"second"


def test_wait_returns_when_keys_exist(store_factory: StoreFactory, uid: str) -> None:
    waiter, writer = store_factory(), store_factory()
    writer.set(f"{uid}/a", "1")
    waiter.wait([f"{uid}/a"])
    thread = later(0.2, lambda: writer.multi_set([f"{uid}/b", f"{uid}/c"], ["2", "3"]))
    try:
        waiter.wait([f"{uid}/a", f"{uid}/b", f"{uid}/c"], timedelta(seconds=10))
    finally:
        thread.join()


def test_wait_timeout_and_cancel_leave_the_connection_usable(store: Store, uid: str) -> None:
    for _ in range(3):
        with pytest.raises(StoreTimeoutError):
            store.wait([f"{uid}/never"], timedelta(milliseconds=200))
    store.set(f"{uid}/k", "v")
    assert store.get(f"{uid}/k") == b"v"
    assert store.check([f"{uid}/k"])


def test_wait_timeout_accepts_seconds(store: Store, uid: str) -> None:
    with pytest.raises(StoreTimeoutError):
        store.wait([f"{uid}/never"], 0.2)


def test_check(store: Store, uid: str) -> None:
    assert not store.check([f"{uid}/x"])
    store.set(f"{uid}/x", "1")
    assert store.check([f"{uid}/x"])
    assert not store.check([f"{uid}/x", f"{uid}/y"])
    assert store.check([])


def test_delete_key(store: Store, uid: str) -> None:
    store.set(f"{uid}/d", "1")
    assert store.delete_key(f"{uid}/d") is True
    assert store.delete_key(f"{uid}/d") is False
    assert not store.check([f"{uid}/d"])


def test_num_keys_counts_sets_and_deletes(store: Store, uid: str) -> None:
    before = store.num_keys()
    store.set(f"{uid}/n1", "1")
    store.set(f"{uid}/n2", "1")
    store.set(f"{uid}/n1", "2")
    assert store.num_keys() == before + 2
    store.delete_key(f"{uid}/n1")
    assert store.num_keys() == before + 1


def test_multi_set_and_multi_get(store: Store, uid: str) -> None:
    keys = [f"{uid}/m{i}" for i in range(5)]
    store.multi_set(keys, [f"v{i}" for i in range(5)])
    assert store.multi_get(keys) == [f"v{i}".encode() for i in range(5)]
    assert store.multi_get(list(reversed(keys[:2]))) == [b"v1", b"v0"]
    with pytest.raises(ValueError, match=r"2 keys but 1 values|differ"):
        store.multi_set(keys[:2], ["x"])


def test_multi_get_times_out_on_a_missing_key(store: Store, uid: str) -> None:
    store.set_timeout(0.3)
    store.set(f"{uid}/here", "1")
    with pytest.raises(StoreTimeoutError):
        store.multi_get([f"{uid}/here", f"{uid}/gone"])


def test_append(store: Store, uid: str) -> None:
    store.append(f"{uid}/ap", "ab")
    store.append(f"{uid}/ap", b"cd")
    assert store.get(f"{uid}/ap") == b"abcd"


def test_list_keys(store: Store, uid: str) -> None:
    names = {f"{uid}/l{i}" for i in range(3)}
    for name in names:
        store.set(name, "x")
    listed = set(store.list_keys())
    assert names <= listed
    store.delete_key(f"{uid}/l0")
    assert f"{uid}/l0" not in store.list_keys()


def test_queue_fifo_and_len(store: Store, uid: str) -> None:
    queue = f"{uid}/q"
    assert store.queue_len(queue) == 0
    for item in ("a", "b", "c"):
        store.queue_push(queue, item)
    assert store.queue_len(queue) == 3
    assert [store.queue_pop(queue) for _ in range(3)] == [b"a", b"b", b"c"]
    assert store.queue_len(queue) == 0


def test_queue_pop_empty_without_blocking_raises(store: Store, uid: str) -> None:
    with pytest.raises(StoreTimeoutError):
        store.queue_pop(f"{uid}/empty", block=False)


def test_queue_pop_blocks_until_a_push(store_factory: StoreFactory, uid: str) -> None:
    popper, pusher = store_factory(), store_factory()
    thread = later(0.2, lambda: pusher.queue_push(f"{uid}/bq", "item"))
    try:
        assert popper.queue_pop(f"{uid}/bq") == b"item"
    finally:
        thread.join()


def test_queue_pop_blocking_times_out(store: Store, uid: str) -> None:
    store.set_timeout(0.3)
    with pytest.raises(StoreTimeoutError):
        store.queue_pop(f"{uid}/never")


def test_a_queue_with_items_is_an_existing_key(store: Store, uid: str) -> None:
    """As on torch's server, which every pairing here matches: ``check`` and
    ``wait`` see a queue's key while the queue holds items (torch's blocking
    ``queue_pop`` is a ``wait`` on it), yet a queue is no value for
    ``num_keys`` or ``list_keys``."""
    queue = f"{uid}/cq"
    assert not store.check([queue])
    store.queue_push(queue, "item")
    assert store.check([queue])
    store.wait([queue], timedelta(seconds=5))
    assert queue not in store.list_keys()
    assert store.queue_pop(queue) == b"item"
    assert not store.check([queue])
    with pytest.raises(StoreTimeoutError):
        store.wait([queue], timedelta(milliseconds=200))


def test_try_multi_get(store: Store, uid: str) -> None:
    store.set(f"{uid}/t1", "one")
    store.set(f"{uid}/t3", b"")
    assert store.try_multi_get([f"{uid}/t1", f"{uid}/t2", f"{uid}/t3"]) == [b"one", None, b""]
    assert store.try_multi_get([]) == []


def test_watch(store_factory: StoreFactory, uid: str) -> None:
    watcher, writer = store_factory(), store_factory()
    key = f"{uid}/w"
    if not watcher.supports_watch:
        with pytest.raises(NotImplementedError):
            watcher.watch(key, None, 0.1)
        return
    # No change within the timeout: the previous value comes back.
    assert watcher.watch(key, None, 0.1) is None
    writer.set(key, "v1")
    # Already different: immediate.
    assert watcher.watch(key, None, 5) == b"v1"
    assert watcher.watch(key, b"v1", 0.1) == b"v1"
    # A later change wakes the watcher.
    thread = later(0.2, lambda: writer.set(key, "v2"))
    try:
        assert watcher.watch(key, b"v1", 10) == b"v2"
    finally:
        thread.join()
    # Writing the same value is not a change; a delete is.
    writer.set(key, "v2")
    assert watcher.watch(key, b"v2", 0.1) == b"v2"
    thread = later(0.2, lambda: writer.delete_key(key))
    try:
        assert watcher.watch(key, b"v2", 10) is None
    finally:
        thread.join()


def test_keys_with_odd_characters(store: Store, uid: str) -> None:
    for key in (f"{uid}/with space", f"{uid}/ünï", f"{uid}//double", f"{uid}/"):
        store.set(key, key)
        assert store.get(key) == key.encode()
