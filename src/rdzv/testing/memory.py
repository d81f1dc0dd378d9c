"""An in-memory rendezvous backend with every capability, for tests.

Several :class:`InMemoryBackend` objects built on one
:class:`InMemoryRendezvousStorage` behave like several clients of one
server: they share the state, the join queues and the heartbeats. The
storage counts operations and bytes, can be told to fail the next calls
with :class:`~rdzv.errors.RendezvousConnectionError`, and can corrupt its
state record.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from rdzv.backends.base import (
    LivenessBackend,
    NamedQueues,
    RendezvousBackend,
    SeatedBackend,
    Token,
    WatchableBackend,
    revision_token,
    validate_node_key,
    validate_record,
    validate_seats,
)
from rdzv.errors import RendezvousConnectionError, RendezvousStateError
from rdzv.retry import Clock

__all__ = ["InMemoryBackend", "InMemoryRendezvousStorage", "OperationCounts"]

_GENERATION_BYTES = 8


@dataclass
class OperationCounts:
    """Operations a storage served.

    Attributes:
        reads: Calls that only read.
        writes: Calls that wrote (or tried to: failed compare-and-sets count).
        failed_cas: Compare-and-sets that did not write.
        bytes_written: Bytes of state and records written.
        bytes_read: Bytes of state and records returned.
    """

    reads: int = 0
    writes: int = 0
    failed_cas: int = 0
    bytes_written: int = 0
    bytes_read: int = 0


class InMemoryRendezvousStorage:
    """The shared "server" side of :class:`InMemoryBackend` objects."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.record: bytes | None = None
        self.queues: dict[int, list[bytes]] = {}
        self.confirmations: dict[int, list[bytes]] = {}
        self.marks: dict[str, int] = {}
        self.seats: dict[str, tuple[int, bytes]] = {}
        self.waiters: set[threading.Event] = set()
        self.counts = OperationCounts()
        self._failures = 0

    def notify(self) -> None:
        """Wake every waiting backend call (callers hold ``changed``)."""
        for event in self.waiters:
            event.set()

    def fail_next(self, calls: int) -> None:
        """Make the next ``calls`` backend calls raise ``RendezvousConnectionError``."""
        with self.changed:
            self._failures = calls

    def corrupt_state(self) -> None:
        """Replace the state record by bytes that do not decode."""
        with self.changed:
            self.record = b"\xff"
            self.notify()

    def wipe(self) -> None:
        """Forget the state, the join queues and the heartbeats, as a store restarted empty."""
        with self.changed:
            self.record = None
            self.queues.clear()
            self.confirmations.clear()
            self.marks.clear()
            self.seats.clear()
            self.notify()

    @contextlib.contextmanager
    def call(self, writes: bool = False) -> Iterator[InMemoryRendezvousStorage]:
        """Hold the lock for one backend call: raise a pending injected failure, then count it."""
        with self.changed:
            if self._failures > 0:
                self._failures -= 1
                raise RendezvousConnectionError("injected failure: the in-memory backend is down")
            if writes:
                self.counts.writes += 1
            else:
                self.counts.reads += 1
            yield self


def _split(record: bytes) -> tuple[bytes, int]:
    if len(record) < _GENERATION_BYTES:
        raise RendezvousStateError(
            f"the stored rendezvous record is corrupt: {len(record)} bytes, "
            f"shorter than its {_GENERATION_BYTES}-byte header"
        )
    return record[_GENERATION_BYTES:], int.from_bytes(record[:_GENERATION_BYTES], "big")


class InMemoryBackend(
    RendezvousBackend, WatchableBackend, SeatedBackend, NamedQueues, LivenessBackend
):
    """A backend keeping everything in an :class:`InMemoryRendezvousStorage`.

    Tokens are generation numbers (ints). Any other token is invalid.

    Args:
        storage: The shared storage; a new one when None.
        clock: The clock the waits for changes run on; real time when None.
    """

    def __init__(
        self, storage: InMemoryRendezvousStorage | None = None, clock: Clock | None = None
    ) -> None:
        self.storage = storage if storage is not None else InMemoryRendezvousStorage()
        self._clock = clock if clock is not None else Clock()

    def _queues(self) -> dict[int, list[bytes]]:
        """The join queues, or for the view of :meth:`confirmation_queue` the confirmations."""
        storage = self.storage
        return storage.confirmations if self._queue_name == "confirm" else storage.queues

    def _wait_change(self, deadline: float) -> None:
        """Wait (the caller holds ``changed``) until the storage changes or ``deadline``."""
        storage = self.storage
        event = threading.Event()
        storage.waiters.add(event)
        storage.changed.release()
        try:
            self._clock.wait(event, deadline - self._clock())
        finally:
            storage.changed.acquire()
            storage.waiters.discard(event)

    @property
    def name(self) -> str:
        """Always ``memory``."""
        return "memory"

    def _current(self) -> tuple[bytes, int] | None:
        record = self.storage.record
        return None if record is None else _split(record)

    def get_state(self) -> tuple[bytes, Token] | None:  # noqa: D102 - see RendezvousBackend
        with self.storage.call() as storage:
            current = self._current()
            if current is not None:
                storage.counts.bytes_read += len(current[0])
            return current

    def set_state(  # noqa: D102 - see RendezvousBackend
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        return self.set_state_seated(state, token, {})

    def set_state_seated(  # noqa: D102 - see SeatedBackend
        self, state: bytes, token: Token | None, seats: Mapping[str, bytes]
    ) -> tuple[bytes, Token, bool] | None:
        validate_seats(seats)
        with self.storage.call(writes=True) as storage:
            current = self._current()
            if revision_token(token) != (0 if current is None else current[1]):
                storage.counts.failed_cas += 1
                return None if current is None else (current[0], current[1], False)
            generation = 1 if current is None else current[1] + 1
            storage.record = generation.to_bytes(_GENERATION_BYTES, "big") + bytes(state)
            storage.counts.bytes_written += len(state) + sum(len(seat) for seat in seats.values())
            storage.seats.update((node, (generation, bytes(seat))) for node, seat in seats.items())
            storage.notify()
            return bytes(state), generation, True

    def _await_change(self, token: Token | None, timeout: float) -> tuple[bytes, int] | None:
        """Wait (the caller holds ``changed``) until the token differs from ``token``; return the state."""
        deadline = self._clock() + max(0.0, timeout)
        while True:
            current = self._current()
            generation = None if current is None else current[1]
            if generation != token or deadline - self._clock() <= 0:
                return current
            self._wait_change(deadline)

    def wait_for_state(  # noqa: D102 - see WatchableBackend
        self, token: Token | None, timeout: float
    ) -> tuple[bytes, Token] | None:
        with self.storage.call() as storage:
            current = self._await_change(token, timeout)
            if current is not None:
                storage.counts.bytes_read += len(current[0])
            return current

    def read_token(self) -> Token | None:  # noqa: D102 - see SeatedBackend
        with self.storage.call():
            current = self._current()
            return None if current is None else current[1]

    def wait_for_token(  # noqa: D102 - see SeatedBackend
        self, token: Token | None, timeout: float
    ) -> Token | None:
        with self.storage.call():
            current = self._await_change(token, timeout)
            return None if current is None else current[1]

    def read_seat(self, token: Token, node: str) -> bytes | None:  # noqa: D102 - see SeatedBackend
        validate_node_key(node)
        with self.storage.call() as storage:
            found = storage.seats.get(node)
            if found is None or found[0] != token:
                return None
            storage.counts.bytes_read += len(found[1])
            return found[1]

    def enqueue(self, round_id: int, record: bytes) -> int:  # noqa: D102 - see JoinQueueBackend
        validate_record(round_id, record)
        with self.storage.call(writes=True) as storage:
            storage.counts.bytes_written += len(record)
            queue = self._queues().setdefault(round_id, [])
            queue.append(bytes(record))
            storage.notify()
            return len(queue)

    def queue_records(self, round_id: int) -> list[bytes]:  # noqa: D102
        with self.storage.call() as storage:
            records = list(self._queues().get(round_id, ()))
            storage.counts.bytes_read += sum(len(r) for r in records)
            return records

    def queue_length(self, round_id: int) -> int:  # noqa: D102
        with self.storage.call():
            return len(self._queues().get(round_id, ()))

    def wait_queue_length(self, round_id: int, known: int, timeout: float) -> int:  # noqa: D102
        deadline = self._clock() + max(0.0, timeout)
        with self.storage.call():
            while True:
                length = len(self._queues().get(round_id, ()))
                if length != known or deadline - self._clock() <= 0:
                    return length
                self._wait_change(deadline)

    def drop_queue(self, round_id: int) -> None:  # noqa: D102
        with self.storage.call(writes=True) as storage:
            self._queues().pop(round_id, None)
            storage.notify()

    def beat(self, node: str) -> None:  # noqa: D102 - see LivenessBackend
        validate_node_key(node)
        with self.storage.call(writes=True) as storage:
            storage.marks[node] = storage.marks.get(node, 0) + 1

    def heartbeat_mark(self, node: str) -> bytes | None:  # noqa: D102
        with self.storage.call() as storage:
            mark = storage.marks.get(node)
            return None if mark is None else str(mark).encode()

    def forget(self, node: str) -> None:  # noqa: D102
        with self.storage.call(writes=True) as storage:
            storage.marks.pop(node, None)
