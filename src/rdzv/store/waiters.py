"""The blocked requests of a store engine and the index that finds them by key.

Theory of operation
-------------------
A blocked request (``WAIT``, ``BARRIER``, ``GET_WAIT``, ``WATCH``) is a
:class:`Waiter`, indexed under every key it names, so that a write reaches
only the waiters of its key (:meth:`WaiterIndex.notify`). A key with one
waiter is indexed to that waiter itself, without a set.

A ``WAIT`` counts its missing keys: :meth:`WaiterIndex.notify` moves the
count of each waiter of a key by one when the key comes into or goes out of
existence, and answers the waiter at zero. The count is taken as each key is
indexed, so it stays right whatever changes while a waiter is being indexed.

Indexing and removing a waiter cost one step per key it names: 128 Ki steps,
tens of milliseconds, for the largest ``WAIT``. A driver with an event loop
must not spend that in one callback, so it hands the index a ``schedule``
callable: a waiter of more than :data:`WAIT_SLICE` keys is then indexed and
removed :data:`WAIT_SLICE` keys per call of :meth:`WaiterIndex.work`, which
``schedule`` arranges to be called soon, once per turn of the loop. While
such a waiter is being indexed it cannot be answered (its count is not
complete); once removed (answered, cancelled, dropped) it is marked dead at
once, and its index entries, skipped by every write, are cleared in later
slices, its bytes still counted until they are. Without ``schedule``
(the in-process store, under its lock) everything is done at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import Final, Generic, TypeAlias, TypeVar

from rdzv.store.protocol import WaitResult

__all__ = ["STOP_WAITING", "WAIT_SLICE", "WAITED_KEY_OVERHEAD", "Waiter", "WaiterIndex", "Woken"]

WAIT_SLICE: Final = 1024
"""Keys of large blocked requests indexed or cleared per call of
:meth:`WaiterIndex.work`: about a millisecond. A request naming no more
keys than this is indexed at once."""

WAITED_KEY_OVERHEAD: Final = 128
"""Bytes counted against ``max_waiting_bytes`` for each key a blocked request
names, besides the key's own length: about what CPython spends on it (the
bytes object, the blocked request's reference, the index entry)."""

STOP_WAITING: Final = bytes([WaitResult.STOP_WAITING])
"""The reply that ends a ``WAIT`` or ``BARRIER``."""

ClientT = TypeVar("ClientT", bound=Hashable)

Woken: TypeAlias = Sequence[tuple[ClientT, bytes]]
"""Replies owed to blocked clients: ``(client, reply)`` pairs."""


class Waiter(Generic[ClientT]):
    """A blocked request: its client, its keys, and what answers it.

    ``ready`` is None for a ``WAIT``, which counts its ``missing`` keys;
    otherwise it returns the reply once the one key's value allows it.
    """

    __slots__ = (
        "cleared",
        "client",
        "cost",
        "dead",
        "indexed",
        "keys",
        "missing",
        "on_timeout",
        "queued",
        "ready",
        "timeout_ms",
    )

    def __init__(
        self,
        client: ClientT,
        keys: tuple[bytes, ...],
        *,
        ready: Callable[[], bytes | None] | None = None,
        timeout_ms: int | None = None,
        on_timeout: bytes | None = None,
    ) -> None:
        self.client = client
        self.keys = keys
        self.missing = 0
        self.ready = ready
        self.timeout_ms = timeout_ms
        self.on_timeout = on_timeout
        self.cost = 0
        self.indexed = 0
        """How many of ``keys`` were indexed so far."""
        self.cleared = 0
        """How many of the indexed keys were cleared from the index since it died."""
        self.dead = False
        """Whether it was removed (its index entries may still be being cleared)."""
        self.queued = False
        """Whether it waits in :class:`WaiterIndex`'s work, to be indexed or cleared."""


class WaiterIndex(Generic[ClientT]):
    """The blocked requests, by client and by key (not thread-safe).

    Args:
        exists: Whether a key exists (has a value or a non-empty queue).
        schedule: Called when work for :meth:`work` was queued and none was
            before: the driver must then call :meth:`work` soon, and again
            while :attr:`has_work`. None does all the work at once.
    """

    def __init__(
        self, exists: Callable[[bytes], bool], schedule: Callable[[], None] | None = None
    ) -> None:
        self._exists = exists
        self.by_key: dict[bytes, Waiter[ClientT] | set[Waiter[ClientT]]] = {}
        """The waiters of each key: the waiter itself when it is the only one."""
        self.blocked: dict[ClientT, Waiter[ClientT]] = {}
        """The live waiter of each blocked client."""
        self.waiting_bytes = 0
        """What the waiters hold, dead ones not cleared yet included."""
        self.checks = 0
        """How many times a write examined a waiter, in total."""
        self._schedule = schedule
        self._jobs: deque[Waiter[ClientT]] = deque()
        """Waiters being indexed (alive) or cleared (dead), in order."""

    @property
    def has_work(self) -> bool:
        """Whether waiters are still being indexed or cleared."""
        return bool(self._jobs)

    def block(self, waiter: Waiter[ClientT], cost: int) -> bool:
        """Index ``waiter``, which costs ``cost`` bytes; return whether it is answered already.

        It is answered already when it is a ``WAIT`` indexed at once whose keys
        all exist (the caller replies and the waiter is gone). A large one is
        indexed in slices, and :meth:`work` answers it if need be.
        """
        self.blocked[waiter.client] = waiter
        waiter.cost = cost
        self.waiting_bytes += cost
        if self._schedule is not None and len(waiter.keys) > WAIT_SLICE:
            self._queue(waiter)
            return False
        self._index_keys(waiter, len(waiter.keys))
        if waiter.ready is None and not waiter.missing:
            self.remove(waiter)
            return True
        return False

    def remove(self, waiter: Waiter[ClientT]) -> None:
        """Remove ``waiter`` (answered or ended); a large one's entries are cleared in slices."""
        del self.blocked[waiter.client]
        waiter.dead = True
        if waiter.queued:
            return  # its turn in the work clears what it indexed
        if self._schedule is not None and waiter.indexed > WAIT_SLICE:
            self._queue(waiter)
            return
        self._clear_keys(waiter, waiter.indexed)
        self.waiting_bytes -= waiter.cost

    def notify(self, key: bytes, existence: int) -> Woken[ClientT]:
        """Answer the waiters of ``key`` that its change satisfied.

        ``existence`` is +1 if the key came into existence, -1 if it ceased
        to, 0 if only its value changed (or nothing did).
        """
        waiting = self.by_key.get(key)
        if not waiting:
            return ()
        woken: list[tuple[ClientT, bytes]] = []
        for waiter in list(waiting) if isinstance(waiting, set) else (waiting,):
            if waiter.dead:
                continue
            self.checks += 1
            if waiter.ready is None:
                if not existence:
                    continue
                waiter.missing -= existence
                if waiter.missing or waiter.indexed < len(waiter.keys):
                    continue
                reply: bytes | None = STOP_WAITING
            else:
                reply = waiter.ready()
            if reply is not None:
                self.remove(waiter)
                woken.append((waiter.client, reply))
        return woken

    def work(self) -> Woken[ClientT]:
        """Index or clear the next :data:`WAIT_SLICE` keys; return the ``WAIT`` s it answered."""
        budget = WAIT_SLICE
        woken: list[tuple[ClientT, bytes]] = []
        jobs = self._jobs
        while jobs and budget > 0:
            waiter = jobs[0]
            if waiter.dead:
                stop = min(waiter.indexed, waiter.cleared + budget)
                budget -= stop - waiter.cleared
                self._clear_keys(waiter, stop)
                if stop < waiter.indexed:
                    break
                jobs.popleft()
                waiter.queued = False
                self.waiting_bytes -= waiter.cost
                continue
            stop = min(len(waiter.keys), waiter.indexed + budget)
            budget -= stop - waiter.indexed
            self._index_keys(waiter, stop)
            if stop < len(waiter.keys):
                break
            if not waiter.missing:
                self.remove(waiter)  # dead now, it stays at the head to be cleared
                woken.append((waiter.client, STOP_WAITING))
                continue
            jobs.popleft()
            waiter.queued = False
        return woken

    def _queue(self, waiter: Waiter[ClientT]) -> None:
        if not self._jobs and self._schedule is not None:
            self._schedule()
        self._jobs.append(waiter)
        waiter.queued = True

    def _index_keys(self, waiter: Waiter[ClientT], stop: int) -> None:
        """Index ``waiter``'s keys up to ``stop``, counting the missing ones (a ``WAIT``).

        A key it named before is skipped, and no longer counted in its cost.
        """
        index = self.by_key
        exists = self._exists
        counting = waiter.ready is None
        for key in waiter.keys[waiter.indexed : stop]:
            waiting = index.get(key)
            if waiting is None:
                index[key] = waiter
            elif waiting is waiter or (isinstance(waiting, set) and waiter in waiting):
                self.waiting_bytes -= len(key) + WAITED_KEY_OVERHEAD
                waiter.cost -= len(key) + WAITED_KEY_OVERHEAD
                continue
            elif isinstance(waiting, set):
                waiting.add(waiter)
            else:
                index[key] = {waiting, waiter}
            if counting and not exists(key):
                waiter.missing += 1
        waiter.indexed = stop

    def _clear_keys(self, waiter: Waiter[ClientT], stop: int) -> None:
        """Take ``waiter`` out of the index entries of its keys up to ``stop``."""
        index = self.by_key
        for key in waiter.keys[waiter.cleared : stop]:
            waiting = index.get(key)
            if waiting is waiter:
                del index[key]
            elif isinstance(waiting, set) and waiter in waiting:
                waiting.discard(waiter)
                if len(waiting) == 1:
                    index[key] = waiting.pop()
        waiter.cleared = stop
