"""The join-queue, liveness and verdict capabilities over any key-value :class:`~rdzv.store.base.Store`.

A backend that keeps only the shared state (compare-and-set on one blob)
gets the capabilities that make a formation linear from its store:

* :class:`StoreJoinQueue`: ``append`` of a length-prefixed record, then
  ``add`` on the round's counter (two non-conflicting operations per joining
  node; waiting is ``watch`` on the counter, or polling with jittered,
  capped backoff on stores without watch, on the caller's clock);
* :class:`StoreLiveness`: ``add(key, 1)`` on a per-node counter, the marks read in one call;
* :class:`StoreVerdict`: a sealed round's verdict as a key, waited for in
  slices with a look at the state's token between them.

The c10d backend is built from the first two, and the dynamic handler falls
back to them for backends that lack the capabilities. The store may be rdzv's or
torch's (:func:`~rdzv.store.foreign.as_store`). Store failures become
:class:`~rdzv.errors.RendezvousConnectionError`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from functools import partial
from typing import TypeVar

from rdzv.backends.base import (
    GONE_MARK,
    JoinQueueBackend,
    LivenessBackend,
    Token,
    VerdictBackend,
    validate_node_key,
    validate_record,
)
from rdzv.errors import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousStateError,
    StoreTimeoutError,
)
from rdzv.keys import CONFIRM_QUEUE, JOIN_QUEUE, heartbeat_key, queue_keys, verdict_key
from rdzv.retry import current_clock, poll_backoff
from rdzv.store.base import Stoppable, Store
from rdzv.store.foreign import StoreLike, as_store

__all__ = ["StoreJoinQueue", "StoreLiveness", "StoreVerdict", "store_call"]

_T = TypeVar("_T")


def store_call(what: str, fn: Callable[[], _T]) -> _T:
    """Run a store call, translating foreign failures to RendezvousConnectionError."""
    try:
        return fn()
    except RendezvousError:
        raise
    except (OSError, EOFError, RuntimeError, ValueError) as exc:
        raise RendezvousConnectionError(
            f"the rendezvous store failed during {what}: {exc}"
        ) from exc


class StoreJoinQueue(JoinQueueBackend):
    """The join-queue capability over a store.

    Args:
        store: The store: an rdzv store or one with torch's ``Store`` API
            (:func:`~rdzv.store.foreign.as_store`).
        prefix: The key prefix (ends with ``/``).
        kind: The queues' name under the prefix: ``q`` for join queues,
            ``c`` for confirmations (:meth:`confirmation_queue`).
    """

    def __init__(self, store: StoreLike, prefix: str, kind: str = JOIN_QUEUE) -> None:
        self._queue_store: Store = as_store(store)
        self._queue_prefix = prefix
        self._queue_kind = kind

    def _queue_keys(self, round_id: int) -> tuple[str, str]:
        return queue_keys(self._queue_prefix, self._queue_kind, round_id)

    def confirmation_queue(self) -> StoreJoinQueue:
        """Return the confirmation queues, keyed ``<prefix>c/<round>`` in the same store."""
        return StoreJoinQueue(self._queue_store, self._queue_prefix, CONFIRM_QUEUE)

    def enqueue(self, round_id: int, record: bytes) -> int:  # noqa: D102 - see JoinQueueBackend
        validate_record(round_id, record)
        data_key, count_key = self._queue_keys(round_id)
        framed = b"%d:" % len(record) + record
        store = self._queue_store
        store_call("enqueue", lambda: store.append(data_key, framed))
        return store_call("enqueue", lambda: store.add(count_key, 1))

    def queue_records(self, round_id: int) -> list[bytes]:  # noqa: D102
        data_key, _ = self._queue_keys(round_id)
        store = self._queue_store
        # One read that never waits: a queue dropped (or a store restarted)
        # between a presence check and a get would make the get block for
        # the store's whole timeout.
        raw = store_call("queue_records", lambda: store.try_multi_get([data_key]))[0]
        if raw is None:
            return []
        records: list[bytes] = []
        offset = 0
        while offset < len(raw):
            colon = raw.find(b":", offset, offset + 12)
            size_text = raw[offset:colon] if colon > offset else b""
            if not size_text.isdigit():
                raise RendezvousStateError(f"the join queue of round {round_id} is corrupt")
            start = colon + 1
            end = start + int(size_text)
            if end > len(raw):
                raise RendezvousStateError(f"the join queue of round {round_id} is truncated")
            records.append(raw[start:end])
            offset = end
        return records

    def queue_length(self, round_id: int) -> int:  # noqa: D102
        _, count_key = self._queue_keys(round_id)
        return store_call("queue_length", lambda: self._queue_store.add(count_key, 0))

    def wait_queue_length(self, round_id: int, known: int, timeout: float) -> int:  # noqa: D102
        _, count_key = self._queue_keys(round_id)
        store = self._queue_store
        clock = current_clock()
        deadline = clock() + timeout
        attempt = 0
        while True:
            # add(key, 0) reads the counter and creates it, so a watch that
            # follows has an exact "previous" value to compare against.
            length = self.queue_length(round_id)
            remaining = deadline - clock()
            if length != known or remaining <= 0:
                return length
            if store.supports_watch:
                previous = str(length).encode()
                with clock.blocking(remaining):
                    store_call(
                        "wait_queue_length", partial(store.watch, count_key, previous, remaining)
                    )
            else:
                clock.sleep(min(remaining, poll_backoff(attempt)))
                attempt += 1

    def drop_queue(self, round_id: int) -> None:  # noqa: D102
        data_key, count_key = self._queue_keys(round_id)
        store = self._queue_store
        store_call("drop_queue", lambda: store.delete_key(data_key))
        store_call("drop_queue", lambda: store.delete_key(count_key))


class StoreLiveness(LivenessBackend):
    """The liveness capability over a store: one counter per node.

    Args:
        store: The store: an rdzv store or one with torch's ``Store`` API.
        prefix: The key prefix (ends with ``/``).
    """

    def __init__(self, store: StoreLike, prefix: str) -> None:
        self._liveness_store: Store = as_store(store)
        self._liveness_prefix = prefix
        self._wills: dict[str, Stoppable | None] = {}
        self._wills_lock = threading.Lock()

    def _beat_key(self, node: str) -> str:
        return heartbeat_key(self._liveness_prefix, validate_node_key(node))

    def beat(self, node: str) -> None:  # noqa: D102 - see LivenessBackend
        key = self._beat_key(node)
        store = self._liveness_store
        try:
            store_call("beat", lambda: store.add(key, 1))
        except RendezvousConnectionError:
            # A counter that holds no integer (a stray or hostile write) fails
            # every add; replace it, so this node beats again. A real
            # connection failure fails this read too and is raised.
            value = store_call("beat", lambda: store.try_multi_get([key]))[0]
            if value is None or value.strip().lstrip(b"-").isdigit():
                raise
            store_call("beat", lambda: store.compare_set(key, value, b"1"))

    def heartbeat_mark(self, node: str) -> bytes | None:  # noqa: D102
        return self.heartbeat_marks([node])[node]

    def heartbeat_marks(self, nodes: Sequence[str]) -> dict[str, bytes | None]:
        """Read the marks of ``nodes`` in one call (``try_multi_get``).

        A mark is the counter's stored bytes; a missing counter, or one at 0,
        is None ("never beat"). A counter that holds no integer is returned
        as it is: an opaque mark that does not change counts as no beat.
        """
        keys = [self._beat_key(node) for node in nodes]
        store = self._liveness_store
        values = store_call("heartbeat_marks", lambda: store.try_multi_get(keys)) if keys else []
        return {
            node: None if value is None or value == b"0" else value
            for node, value in zip(nodes, values, strict=True)
        }

    def forget(self, node: str) -> None:  # noqa: D102
        key = self._beat_key(node)
        store_call("forget", lambda: self._liveness_store.delete_key(key))

    def present(self, node: str) -> None:
        """Keep a will that sets ``node``'s counter to :data:`GONE_MARK` when this process dies.

        On rdzv's TCP store (:meth:`Store.keep_will
        <rdzv.store.base.Store.keep_will>`); elsewhere nothing happens.
        """
        with self._wills_lock:
            if node not in self._wills:
                self._wills[node] = self._liveness_store.keep_will(
                    self._beat_key(node), GONE_MARK, partial(self._restore, node)
                )

    def absent(self, node: str) -> None:  # noqa: D102 - see LivenessBackend
        with self._wills_lock:
            will = self._wills.pop(node, None)
        if will is not None:
            will.stop()

    def _restore(self, node: str) -> None:
        """Beat after a will was made again: the old connection's will may have fired."""
        self.beat(node)


class StoreVerdict(VerdictBackend):
    """The verdict capability over a store: a key, watched in slices with a look at the token between.

    On a store that watches, a slice is one request (the server ends it);
    elsewhere two (a cut-short ``WAIT`` needs its ``CANCEL_WAIT``).

    Args:
        store: The store.
        prefix: The key prefix (ends with ``/``).
        changed: Tells whether the state was written after the write of a token.
        period: The longest slice, in seconds.
    """

    def __init__(
        self, store: Store, prefix: str, changed: Callable[[Token], bool], period: float
    ) -> None:
        self._verdict_store = store
        self._verdict_prefix = prefix
        self._changed = changed
        self._period = period

    def set_verdict(self, round_id: int) -> None:  # noqa: D102 - see VerdictBackend
        self._verdict_store.set(verdict_key(self._verdict_prefix, round_id), b"confirmed")

    def wait_for_verdict(self, round_id: int, token: Token, timeout: float) -> bool | None:  # noqa: D102
        key = verdict_key(self._verdict_prefix, round_id)
        store, clock = self._verdict_store, current_clock()
        deadline = clock() + timeout
        while True:
            seconds = max(0.0, min(self._period, deadline - clock()))
            with clock.blocking(seconds):
                if store.supports_watch:
                    if store.watch(key, None, seconds) is not None:
                        return True
                else:
                    with contextlib.suppress(StoreTimeoutError):
                        store.wait([key], timedelta(seconds=seconds))
                        return True
            if self._changed(token):
                return False
            if clock() >= deadline:
                return None

    def drop_verdict(self, round_id: int) -> None:  # noqa: D102
        self._verdict_store.delete_key(verdict_key(self._verdict_prefix, round_id))
