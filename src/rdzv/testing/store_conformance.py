"""A reusable conformance suite for stores: torch's ``Store`` semantics.

Every :class:`~rdzv.store.base.Store` runs the same checks: values, counters,
compare-and-set, waits and their timeouts, several clients of one store,
and the checks of each optional capability the store offers (queues among
them: torch's own ``FileStore`` has none). The
suite has the shape of :mod:`rdzv.testing.conformance`: checks are data, a
:class:`StoreHarness` makes clients of the store under test, and pytest is
not needed. Use it from pytest like this::

    from rdzv.testing.store_conformance import STORE_CHECKS, StoreHarness

    @pytest.mark.parametrize("check", STORE_CHECKS, ids=lambda c: c.name)
    def test_store(check, my_harness: StoreHarness) -> None:
        check.run(my_harness)   # skips itself when a capability is missing

or call :func:`run_store_conformance` to run every applicable check at once.
Keys start with a fresh random prefix in every check, so clients of a server
shared by many checks do not see each other's keys.
"""

from __future__ import annotations

import enum
import threading
import time
import unittest
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

from rdzv.errors import RendezvousConnectionError, StoreTimeoutError
from rdzv.store.base import Store
from rdzv.store.memory import PrefixStore
from rdzv.testing.conformance import ConformanceError, _expect, _run_checks, _run_threads

__all__ = ["STORE_CHECKS", "StoreCapability", "StoreCheck", "StoreHarness", "run_store_conformance"]

#: Long enough for any wait the suite expects to succeed.
_PATIENT = 10.0
#: The timeout of the waits the suite expects to time out.
_IMPATIENT = 0.3


class StoreCapability(enum.Enum):
    """What some stores offer beyond torch's ``Store`` API."""

    #: :meth:`Store.watch` blocks until a key changes (``supports_watch``).
    WATCH = "watch"
    #: One client serves a blocking call from one thread while another thread
    #: uses it (torch's TCP clients serialise calls on their one connection).
    SHARED_CLIENT = "shared_client"
    #: A queue that holds items is an existing key for ``check`` and ``wait``,
    #: as on torch's server (rdzv's server and ``HashStore`` too; the etcd,
    #: Redis and file stores keep queues apart from keys).
    QUEUE_KEY = "queue_key"
    #: ``queue_push``, ``queue_pop`` and ``queue_len`` (torch's ``FileStore``
    #: and its legacy TCP server have none).
    QUEUES = "queues"
    #: ``delete_key`` tells whether the key existed (torch's ``FileStore``
    #: says True for a missing key too).
    DELETE_RESULT = "delete_result"


class StoreHarness(ABC):
    """Gives the suite clients of ONE store under test."""

    #: The optional capabilities the store offers; the suite checks that the
    #: store advertises the same and skips the checks of the others.
    capabilities: frozenset[StoreCapability] = frozenset(StoreCapability)

    @abstractmethod
    def connect(self) -> Store:
        """Return a client of the harness's store (all share the same keys).

        Returns:
            A store, possibly the same object each time for an in-process
            store. The harness closes what it made in :meth:`close`.
        """

    def close(self) -> None:  # noqa: B027 - optional hook with a no-op default
        """Release the harness's clients and store; the default does nothing."""


@dataclass(frozen=True)
class StoreCheck:
    """One store conformance check.

    Attributes:
        name: A short identifier.
        capability: The capability it needs, or None for the Store API.
        body: The check; it raises :class:`ConformanceError` on a violation.
    """

    name: str
    capability: StoreCapability | None
    body: Callable[[StoreHarness], None]

    def applies_to(self, harness: StoreHarness) -> bool:
        """Tell whether the store offers what the check needs."""
        return self.capability is None or self.capability in harness.capabilities

    def run(self, harness: StoreHarness) -> None:
        """Run the check, skipping it when the store lacks what it needs.

        Raises:
            ConformanceError: The store broke its contract.
            unittest.SkipTest: The check does not apply (a skip under pytest
                and unittest).
        """
        if not self.applies_to(harness):
            assert self.capability is not None
            raise unittest.SkipTest(f"the store does not offer {self.capability.value}")
        self.body(harness)


def _uid() -> str:
    return uuid.uuid4().hex[:12]


def _raises(
    kinds: type[BaseException] | tuple[type[BaseException], ...],
    call: Callable[[], object],
    what: str,
) -> BaseException:
    try:
        call()
    except kinds as exc:
        return exc
    names = [kind.__name__ for kind in (kinds if isinstance(kinds, tuple) else (kinds,))]
    raise ConformanceError(f"{what} must raise {' or '.join(names)}")


@contextmanager
def _later(delay: float, action: Callable[[], object]) -> Iterator[None]:
    """Run ``action`` in a thread ``delay`` seconds after entering; join it on exit."""
    errors: list[BaseException] = []

    def run() -> None:
        time.sleep(delay)
        try:
            action()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join(timeout=60)
    _expect(not thread.is_alive(), "a delayed write hung for 60 s")
    if errors:
        raise ConformanceError(f"a delayed write failed: {errors[0]!r}") from errors[0]


def _set_get(harness: StoreHarness) -> None:
    store, uid = harness.connect(), _uid()
    store.set(f"{uid}/s", "text é")
    store.set(f"{uid}/b", b"\x00\xffraw")
    _expect(store.get(f"{uid}/s") == "text é".encode(), "a str value comes back as UTF-8")
    _expect(store.get(f"{uid}/b") == b"\x00\xffraw", "a bytes value comes back exactly")
    store.set(f"{uid}/s", "")
    _expect(store.get(f"{uid}/s") == b"", "an empty value is a value")


def _get_times_out(harness: StoreHarness) -> None:
    store, uid = harness.connect(), _uid()
    store.set_timeout(timedelta(seconds=_IMPATIENT))
    _expect(store.timeout == timedelta(seconds=_IMPATIENT), "timeout reports set_timeout")
    started = time.monotonic()
    exc = _raises(StoreTimeoutError, lambda: store.get(f"{uid}/missing"), "get of a missing key")
    _expect(time.monotonic() - started < 5, "get must give up after the store timeout")
    _expect(f"{uid}/missing" in str(exc), f"the timeout must name the key: {exc}")
    store.set(f"{uid}/after", "ok")
    _expect(store.get(f"{uid}/after") == b"ok", "the client must work after a timeout")


def _get_waits_for_another_client(harness: StoreHarness) -> None:
    reader, writer, uid = harness.connect(), harness.connect(), _uid()
    reader.set_timeout(_PATIENT)
    with _later(0.2, lambda: writer.set(f"{uid}/late", "here")):
        _expect(reader.get(f"{uid}/late") == b"here", "get must wait for a later set")


def _add(harness: StoreHarness) -> None:
    store, uid = harness.connect(), _uid()
    _expect(store.add(f"{uid}/n", 5) == 5, "add to a missing key starts from 0")
    _expect(store.add(f"{uid}/n", -7) == -2, "add takes negative amounts")
    _expect(store.add(f"{uid}/n", 0) == -2, "add 0 reads the counter")
    _expect(store.get(f"{uid}/n") == b"-2", "the counter is stored as ASCII decimal")
    store.set(f"{uid}/m", "40")
    _expect(store.add(f"{uid}/m", 2) == 42, "add continues from a value set as text")


def _add_to_a_non_integer(harness: StoreHarness) -> None:
    store, uid = harness.connect(), _uid()
    store.set(f"{uid}/word", "abc")
    # In memory: ValueError; over TCP both servers drop the connection, as torch's does.
    kinds = (ValueError, RendezvousConnectionError, RuntimeError)
    exc = _raises(kinds, lambda: store.add(f"{uid}/word", 1), "add to a non-integer")
    if isinstance(exc, ValueError):
        _expect("not an integer" in str(exc), f"the error must say why: {exc}")
    _expect(harness.connect().get(f"{uid}/word") == b"abc", "a failed add must not write")


def _add_is_atomic(harness: StoreHarness) -> None:
    first, second, uid = harness.connect(), harness.connect(), _uid()
    clients = [first, first, second, second]

    def work(index: int) -> None:
        for _ in range(20):
            clients[index].add(f"{uid}/counter", 1)

    _run_threads(len(clients), work)
    final = first.get(f"{uid}/counter")
    _expect(final == b"80", f"concurrent adds must all count: {final!r}")


def _compare_set(harness: StoreHarness) -> None:
    store, key = harness.connect(), f"{_uid()}/cas"
    missing = store.compare_set(key, "old", "new")
    _expect(missing == b"old", f"missing key, expected set: return expected: {missing!r}")
    _expect(not store.check([key]), "missing key, expected set: nothing is written")
    created = store.compare_set(key, "", "first")
    _expect(created == b"first", f"missing key, expected empty: create: {created!r}")
    _expect(store.get(key) == b"first", "the created value is stored")
    mismatch = store.compare_set(key, "wrong", "second")
    _expect(mismatch == b"first", f"a mismatch returns the current value: {mismatch!r}")
    _expect(store.get(key) == b"first", "a mismatch writes nothing")
    swapped = store.compare_set(key, "first", b"second")
    _expect(swapped == b"second", f"a match returns the new value: {swapped!r}")
    _expect(store.get(key) == b"second", "a match writes")
    present = store.compare_set(key, "", "third")
    _expect(present == b"second", f"present key, expected empty: a mismatch: {present!r}")


def _wait(harness: StoreHarness) -> None:
    waiter, writer, uid = harness.connect(), harness.connect(), _uid()
    writer.set(f"{uid}/a", "1")
    waiter.wait([f"{uid}/a"], _PATIENT)
    with _later(0.2, lambda: writer.multi_set([f"{uid}/b", f"{uid}/c"], ["2", "3"])):
        waiter.wait([f"{uid}/a", f"{uid}/b", f"{uid}/c"], timedelta(seconds=_PATIENT))


def _wait_times_out(harness: StoreHarness) -> None:
    store, uid = harness.connect(), _uid()
    for timeout in (timedelta(seconds=_IMPATIENT), _IMPATIENT, timedelta(seconds=_IMPATIENT)):
        try:
            store.wait([f"{uid}/never"], timeout)
        except StoreTimeoutError:
            continue
        raise ConformanceError(f"wait with timeout {timeout!r} must raise StoreTimeoutError")
    store.set(f"{uid}/k", "v")
    _expect(store.get(f"{uid}/k") == b"v", "the client must work after timed-out waits")
    _expect(store.check([f"{uid}/k"]), "check must work after timed-out waits")


def _check(harness: StoreHarness) -> None:
    store, uid = harness.connect(), _uid()
    _expect(not store.check([f"{uid}/x"]), "check of a missing key is False")
    store.set(f"{uid}/x", "1")
    _expect(store.check([f"{uid}/x"]), "check of a set key is True")
    _expect(not store.check([f"{uid}/x", f"{uid}/y"]), "check needs every key")
    _expect(store.check([]), "check of no keys is True")


def _delete_key(harness: StoreHarness) -> None:
    store, uid = harness.connect(), _uid()
    store.set(f"{uid}/d", "1")
    store.delete_key(f"{uid}/d")
    _expect(not store.check([f"{uid}/d"]), "a deleted key is gone")
    store.delete_key(f"{uid}/d")
    _expect(not store.check([f"{uid}/d"]), "deleting a missing key creates nothing")


def _delete_result(harness: StoreHarness) -> None:
    store, uid = harness.connect(), _uid()
    store.set(f"{uid}/d", "1")
    _expect(store.delete_key(f"{uid}/d") is True, "deleting a key returns True")
    _expect(store.delete_key(f"{uid}/d") is False, "deleting a missing key returns False")


def _num_keys(harness: StoreHarness) -> None:
    store, uid = harness.connect(), _uid()
    before = store.num_keys()
    store.set(f"{uid}/n1", "1")
    store.set(f"{uid}/n2", "1")
    store.set(f"{uid}/n1", "2")
    _expect(store.num_keys() == before + 2, "num_keys counts new keys, not writes")
    store.delete_key(f"{uid}/n1")
    _expect(store.num_keys() == before + 1, "num_keys counts deletes")


def _multi_set_get(harness: StoreHarness) -> None:
    store, uid = harness.connect(), _uid()
    keys = [f"{uid}/m{i}" for i in range(5)]
    store.multi_set(keys, [f"v{i}" for i in range(5)])
    got = store.multi_get(keys)
    _expect(got == [f"v{i}".encode() for i in range(5)], f"multi_get in order: {got}")
    got = store.multi_get(list(reversed(keys[:2])))
    _expect(got == [b"v1", b"v0"], f"multi_get follows the order asked: {got}")
    odd = [f"{uid}/x", f"{uid}/y"]
    exc = _raises(ValueError, lambda: store.multi_set(odd, ["x"]), "multi_set 2 keys, 1 value")
    _expect("2 keys but 1 values" in str(exc) or "differ" in str(exc), f"say why: {exc}")
    _expect(not store.check(odd[:1]), "a refused multi_set writes nothing")


def _multi_get_times_out(harness: StoreHarness) -> None:
    store, uid = harness.connect(), _uid()
    store.set_timeout(_IMPATIENT)
    store.set(f"{uid}/here", "1")
    keys = [f"{uid}/here", f"{uid}/gone"]
    _raises(StoreTimeoutError, lambda: store.multi_get(keys), "multi_get with a missing key")


def _append(harness: StoreHarness) -> None:
    store, uid = harness.connect(), _uid()
    store.append(f"{uid}/ap", "ab")
    store.append(f"{uid}/ap", b"cd")
    _expect(store.get(f"{uid}/ap") == b"abcd", "append creates, then extends")


def _list_keys(harness: StoreHarness) -> None:
    store, uid = harness.connect(), _uid()
    names = {f"{uid}/l{i}" for i in range(3)}
    for name in names:
        store.set(name, "x")
    _expect(names <= set(store.list_keys()), "list_keys lists every key")
    store.delete_key(f"{uid}/l0")
    _expect(f"{uid}/l0" not in store.list_keys(), "list_keys leaves out deleted keys")


def _queue_fifo(harness: StoreHarness) -> None:
    store, queue = harness.connect(), f"{_uid()}/q"
    _expect(store.queue_len(queue) == 0, "an unused queue is empty")
    for item in ("a", "b", "c"):
        store.queue_push(queue, item)
    _expect(store.queue_len(queue) == 3, "queue_len counts items")
    popped = [store.queue_pop(queue) for _ in range(3)]
    _expect(popped == [b"a", b"b", b"c"], f"a queue is first in, first out: {popped}")
    _expect(store.queue_len(queue) == 0, "popping empties the queue")


def _queue_pop_empty(harness: StoreHarness) -> None:
    store, queue = harness.connect(), f"{_uid()}/empty"
    _raises(StoreTimeoutError, lambda: store.queue_pop(queue, block=False), "a pop of nothing")


def _queue_pop_blocks(harness: StoreHarness) -> None:
    popper, pusher, queue = harness.connect(), harness.connect(), f"{_uid()}/bq"
    popper.set_timeout(_PATIENT)
    with _later(0.2, lambda: pusher.queue_push(queue, "item")):
        _expect(popper.queue_pop(queue) == b"item", "a blocking pop must wait for a push")


def _queue_pop_times_out(harness: StoreHarness) -> None:
    store, queue = harness.connect(), f"{_uid()}/never"
    store.set_timeout(_IMPATIENT)
    _raises(StoreTimeoutError, lambda: store.queue_pop(queue), "a blocking pop of an empty queue")


def _queue_key(harness: StoreHarness) -> None:
    # As on torch's server: check and wait see a queue's key while the queue
    # holds items (torch's blocking queue_pop is a wait on it), yet a queue
    # is no value for list_keys.
    store, queue = harness.connect(), f"{_uid()}/cq"
    _expect(not store.check([queue]), "an unused queue's key does not exist")
    store.queue_push(queue, "item")
    _expect(store.check([queue]), "a queue that holds items is an existing key for check")
    store.set_timeout(_PATIENT)
    store.wait([queue])
    _expect(queue not in store.list_keys(), "a queue is no value for list_keys")
    _expect(store.queue_pop(queue) == b"item", "the item pushed comes back")
    _expect(not store.check([queue]), "an emptied queue's key does not exist")
    store.set_timeout(_IMPATIENT)
    _raises(StoreTimeoutError, lambda: store.wait([queue]), "a wait on an emptied queue")


def _queue_one_consumer(harness: StoreHarness) -> None:
    first, second, queue = harness.connect(), harness.connect(), f"{_uid()}/shared"
    items = [f"i{n}".encode() for n in range(30)]
    for item in items:
        first.queue_push(queue, item)
    clients = [first, first, second]
    got: list[bytes] = []
    lock = threading.Lock()

    def consume(index: int) -> None:
        while True:
            try:
                item = clients[index].queue_pop(queue, block=False)
            except StoreTimeoutError:
                return
            with lock:
                got.append(item)

    _run_threads(len(clients), consume)
    _expect(sorted(got) == sorted(items), f"every item goes to exactly one consumer: {got}")


def _try_multi_get(harness: StoreHarness) -> None:
    store, uid = harness.connect(), _uid()
    store.set(f"{uid}/t1", "one")
    store.set(f"{uid}/t3", b"")
    got = store.try_multi_get([f"{uid}/t1", f"{uid}/t2", f"{uid}/t3"])
    _expect(got == [b"one", None, b""], f"try_multi_get gives None for a missing key: {got}")
    _expect(store.try_multi_get([]) == [], "try_multi_get of no keys is empty")


def _watch_advertised(harness: StoreHarness) -> None:
    store = harness.connect()
    offered = StoreCapability.WATCH in harness.capabilities
    _expect(store.supports_watch == offered, f"supports_watch must be {offered}")
    if not offered:
        key = f"{_uid()}/w"
        _raises(NotImplementedError, lambda: store.watch(key, None, 0.1), "watch without watch")


def _watch(harness: StoreHarness) -> None:
    watcher, writer, key = harness.connect(), harness.connect(), f"{_uid()}/w"
    _expect(watcher.watch(key, None, 0.1) is None, "no change in time returns previous")
    with _later(0.2, lambda: writer.set(key, "v1")):
        _expect(watcher.watch(key, None, _PATIENT) == b"v1", "a set wakes a watch of absent")
    _expect(watcher.watch(key, None, _PATIENT) == b"v1", "already different: at once")
    _expect(watcher.watch(key, b"v0", _PATIENT) == b"v1", "any other value differs")
    _expect(watcher.watch(key, b"v1", 0.1) == b"v1", "unchanged: previous on timeout")
    with _later(0.2, lambda: writer.set(key, "v2")):
        _expect(watcher.watch(key, b"v1", _PATIENT) == b"v2", "a later set wakes a watch")
    writer.set(key, "v2")
    _expect(watcher.watch(key, b"v2", 0.1) == b"v2", "writing the same value is no change")
    with _later(0.2, lambda: writer.delete_key(key)):
        _expect(watcher.watch(key, b"v2", _PATIENT) is None, "a delete is a change")


def _shared_client(harness: StoreHarness) -> None:
    store, uid = harness.connect(), _uid()
    store.set_timeout(_PATIENT)
    with _later(0.2, lambda: store.set(f"{uid}/late", b"v")):
        _expect(store.get(f"{uid}/late") == b"v", "a blocked get must not stall a set")
    with _later(0.2, lambda: store.queue_push(f"{uid}/bq", b"item")):
        _expect(store.queue_pop(f"{uid}/bq") == b"item", "a blocked pop must not stall a push")
    if store.supports_watch:
        with _later(0.2, lambda: store.delete_key(f"{uid}/late")):
            _expect(store.watch(f"{uid}/late", b"v", _PATIENT) is None, "nor a watch")


def _odd_keys(harness: StoreHarness) -> None:
    store, uid = harness.connect(), _uid()
    for key in (f"{uid}/with space", f"{uid}/ünï", f"{uid}//double", f"{uid}/"):
        store.set(key, key)
        _expect(store.get(key) == key.encode(), f"the key {key!r} must work")


def _prefix_view(harness: StoreHarness) -> None:
    store, uid = harness.connect(), _uid()
    view = PrefixStore(uid, store)
    view.set("x", b"1")
    _expect(store.get(f"{uid}/x") == b"1", "a PrefixStore writes under its prefix")
    _expect(view.list_keys() == ["x"], f"a PrefixStore lists its keys: {view.list_keys()}")
    _expect(view.add("c", 2) == 2, "a PrefixStore adds")
    _expect(sorted(view.list_keys()) == ["c", "x"], "a PrefixStore lists what add made")


STORE_CHECKS: list[StoreCheck] = [
    StoreCheck("set_get", None, _set_get),
    StoreCheck("get_times_out", None, _get_times_out),
    StoreCheck("get_waits_for_another_client", None, _get_waits_for_another_client),
    StoreCheck("add", None, _add),
    StoreCheck("add_to_a_non_integer", None, _add_to_a_non_integer),
    StoreCheck("add_is_atomic", None, _add_is_atomic),
    StoreCheck("compare_set", None, _compare_set),
    StoreCheck("wait", None, _wait),
    StoreCheck("wait_times_out", None, _wait_times_out),
    StoreCheck("check", None, _check),
    StoreCheck("delete_key", None, _delete_key),
    StoreCheck("delete_result", StoreCapability.DELETE_RESULT, _delete_result),
    StoreCheck("num_keys", None, _num_keys),
    StoreCheck("multi_set_get", None, _multi_set_get),
    StoreCheck("multi_get_times_out", None, _multi_get_times_out),
    StoreCheck("append", None, _append),
    StoreCheck("list_keys", None, _list_keys),
    StoreCheck("queue_fifo", StoreCapability.QUEUES, _queue_fifo),
    StoreCheck("queue_pop_empty", StoreCapability.QUEUES, _queue_pop_empty),
    StoreCheck("queue_pop_blocks", StoreCapability.QUEUES, _queue_pop_blocks),
    StoreCheck("queue_pop_times_out", StoreCapability.QUEUES, _queue_pop_times_out),
    StoreCheck("queue_one_consumer", StoreCapability.QUEUES, _queue_one_consumer),
    StoreCheck("queue_key", StoreCapability.QUEUE_KEY, _queue_key),
    StoreCheck("try_multi_get", None, _try_multi_get),
    StoreCheck("odd_keys", None, _odd_keys),
    StoreCheck("prefix_view", None, _prefix_view),
    StoreCheck("watch_advertised", None, _watch_advertised),
    StoreCheck("watch", StoreCapability.WATCH, _watch),
    StoreCheck("shared_client", StoreCapability.SHARED_CLIENT, _shared_client),
]


def run_store_conformance(factory: Callable[[], StoreHarness]) -> list[str]:
    """Run every applicable check, each on a fresh harness; return the names of those that ran.

    Raises:
        ConformanceError: A check failed; the message names it.
    """
    return _run_checks(STORE_CHECKS, factory, lambda check, harness: check.applies_to(harness))
