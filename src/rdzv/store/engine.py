"""The store engine: keys, queues and blocked requests, with no I/O.

Theory of operation
-------------------
:class:`StoreEngine` is everything a torch TCPStore server does with a
request once it is decoded, and nothing else: no sockets, threads, event
loop or clock. :meth:`StoreEngine.apply` takes one
:class:`~rdzv.store.protocol.Request` from one client and returns the reply
owed to that client (None when there is none, or none yet) together with the
replies owed to *other* clients whose blocked requests it satisfied. A client
is any hashable object the driver picks; the engine only compares clients
and hands them back. Two drivers run the engine: the asyncio server
(:mod:`rdzv.store.server`) writes the replies to connections, and
:class:`~rdzv.store.memory.HashStore` runs it under a lock, so the networked
and in-process stores cannot disagree.

Keys. Values and queues are two dicts; the queue dict holds only non-empty
queues. A key *exists* (for ``CHECK`` and ``WAIT``) when it has a value or a
non-empty queue, as on torch's server, whose client pops a queue by sending
``WAIT`` on its key, then ``QUEUE_POP``. ``GET``, ``GETNUMKEYS`` and
``LIST_KEYS`` see values only. ``APPEND`` extends a value in place (it is
kept as a ``bytearray`` once appended to), so n appends cost time linear in
the final size, which :data:`MAX_APPENDED_BYTES` bounds.

Blocked requests. A ``WAIT``, ``BARRIER``, ``GET_WAIT`` or ``WATCH`` that
cannot be answered at once becomes a waiter, indexed under every key it
depends on; a client has at most one, and may send nothing but
``CANCEL_WAIT`` until it is answered. A write reaches only the waiters of
the keys it wrote, in one of two ways:

* A ``WAIT`` counts its missing keys. It is indexed under all its keys,
  present ones too, and each change of a key's existence (value created or
  deleted, queue filled or emptied) moves the count of the waiters on that
  key by one; at zero the waiter is answered ``STOP_WAITING``. A write
  therefore costs one step per waiter on its key, however many keys those
  waiters name. Where torch's server counts arrivals, a key deleted again
  counts as missing again here, so the reply always means that every key
  exists now.
* The others watch one key's value and re-evaluate a predicate after each
  write to it: the counter reached the world size (``BARRIER``), a value
  exists (``GET_WAIT``), the value differs from the caller's (``WATCH``;
  past :data:`WATCH_DIGEST_PAST` bytes the caller's value is held as its
  length and digest).

Each key a blocked request names costs memory until it is answered: its
bytes and its place in the index. The blocked requests of all clients
together may hold at most ``max_waiting_bytes`` of it, counted as the
length of each key named plus :data:`WAITED_KEY_OVERHEAD` (about what
CPython spends on one more waited key). A request that would pass it is
refused before anything changes, with an error naming the limit, and so is
a ``WAIT`` naming more than ``max_waited_keys`` keys. The index itself, and
how a large waiter is indexed and removed in slices so that an event loop is
never held long, is :mod:`rdzv.store.waiters`.

A waiter leaves the index when it is answered, on ``CANCEL_WAIT`` (answered
``WAIT_CANCELED``), or on :meth:`StoreEngine.drop`, which the driver calls
when the client went away or when the time of a request ran out: the engine
reads no clock, so the driver keeps the timers (:meth:`StoreEngine.timeout_ms`
tells it how long a request may block) and ``drop`` returns the reply a
timeout calls for.

Errors. A request the engine cannot carry out (``ADD`` to a value that is
not an integer, an ``APPEND`` past the cap, a reply that would be larger
than :data:`MAX_REPLY_BYTES`, a blocked request past ``max_waiting_bytes``
or ``max_waited_keys``, a request from a client that is blocked, an opcode that is no store operation) raises
:class:`~rdzv.store.protocol.ProtocolError` and changes nothing: the server
then closes the connection, as torch's server does.

Size: near the project's ~600-line guide: one concept, the keyspace with
its queues, whose handlers all share the one waiter index and waiting budget.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MethodType
from typing import Any, Final, Generic, TypeAlias

from rdzv.store.protocol import (
    MAX_VALUE_BYTES,
    CheckResult,
    GetWaitStatus,
    Op,
    ProtocolError,
    Request,
    WaitResult,
    WatchStatus,
    encode_bytes,
    encode_i64,
)
from rdzv.store.waiters import (
    STOP_WAITING,
    WAIT_SLICE,
    WAITED_KEY_OVERHEAD,
    ClientT,
    Waiter,
    WaiterIndex,
    Woken,
)

__all__ = [
    "BLOCKING_OPS",
    "DEFAULT_MAX_WAITED_KEYS",
    "DEFAULT_MAX_WAITING_BYTES",
    "MAX_APPENDED_BYTES",
    "MAX_REPLY_BYTES",
    "WAITED_KEY_OVERHEAD",
    "WATCH_DIGEST_PAST",
    "StoreEngine",
    "Woken",
]

MAX_APPENDED_BYTES: Final = MAX_VALUE_BYTES
"""Largest value ``APPEND`` may build, in bytes: the largest value a request
may carry. A value is read back whole in one reply, which rdzv's client
refuses past :data:`~rdzv.store.protocol.MAX_VALUE_BYTES`, so a longer value
could be written but never read; with this cap no value on a server outgrows
what ``SET`` may write, and one key costs at most this much however many
appends arrive."""

MAX_REPLY_BYTES: Final = 2 * MAX_VALUE_BYTES
"""Largest reply a request may produce, in bytes. Only requests naming many
keys (``MULTI_GET``, ``MULTI_TRY_GET``) or all of them (``LIST_KEYS``) can
go past it, and they are refused, before the reply is built: a 24 KB
``MULTI_GET`` naming one 1 MiB key 2,000 times would otherwise cost 2 GiB."""

DEFAULT_MAX_WAITING_BYTES: Final = 32 * 1024 * 1024
"""The default of ``max_waiting_bytes``: 32 MiB, about 230,000 waited keys of
16 bytes. A rendezvous, whose thousands of clients each wait on a few keys,
uses a few MiB of it; it refuses the eight ``WAIT`` s of 131,072 keys each
that would otherwise grow the server by 170 MiB."""

DEFAULT_MAX_WAITED_KEYS: Final = 65536
"""The default of ``max_waited_keys``: the most keys one client's ``WAIT``
may name (a client has at most one blocked request). A ``WAIT`` naming the
key of every participant of the largest round (65,536) fits; torch's wire
limit is twice that."""

WATCH_DIGEST_PAST: Final = 64
"""A blocked ``WATCH`` whose value is longer than this many bytes holds the
value's length and SHA-256 digest instead of the value (up to 8 MiB), and
compares the key's new values against those: its memory is then that of its
key, which ``max_waiting_bytes`` counts. The digest of a new value is
computed once per write, however many watchers compare it."""

_Outcome: TypeAlias = tuple["bytes | None", Woken[ClientT]]

BLOCKING_OPS: Final = frozenset({Op.WAIT, Op.BARRIER, Op.GET_WAIT, Op.WATCH})
"""The opcodes whose reply may come later, from another client's write."""

_WAIT_CANCELED: Final = bytes([WaitResult.WAIT_CANCELED])
_READY: Final = bytes([CheckResult.READY])
_NOT_READY: Final = bytes([CheckResult.NOT_READY])
_FOUND: Final = bytes([GetWaitStatus.FOUND])
_TIMED_OUT: Final = bytes([GetWaitStatus.TIMED_OUT])
_WATCH_ABSENT: Final = bytes([WatchStatus.ABSENT])
_WATCH_PRESENT: Final = bytes([WatchStatus.PRESENT])
_WATCH_UNCHANGED: Final = bytes([WatchStatus.UNCHANGED])
_ONE: Final = encode_i64(1)
_ZERO: Final = encode_i64(0)
_ABSENT: Final = b"\x00"
_NOTHING: Final = (None, ())
"""The outcome of a request without a reply that answered no one."""
_PRESENT: Final = b"\x01"


def _check_reply_size(op: Op, size: int) -> None:
    """Refuse a reply of ``size`` bytes past :data:`MAX_REPLY_BYTES`."""
    if size > MAX_REPLY_BYTES:
        raise ProtocolError(
            f"the reply to {op.name} would be {size} bytes, over the limit of "
            f"{MAX_REPLY_BYTES} bytes (MAX_REPLY_BYTES); ask for fewer keys at a time"
        )


def _digest(value: bytes | bytearray) -> bytes:
    return hashlib.sha256(value).digest()


def _show(key: bytes) -> str:
    """Render a key for an error message, shortened."""
    return repr(key) if len(key) <= 64 else f"{key[:64]!r}..."


class StoreEngine(Generic[ClientT]):
    """The keys, queues and blocked requests of one store (not thread-safe).

    Attributes:
        handlers: The function behind :meth:`apply` for each store opcode
            (the others, handshake and authentication, are the connection's),
            for a driver that itself keeps a client with a blocked request to
            ``CANCEL_WAIT`` (the server does, with its dispatch tables, and
            saves a call per request).

    Args:
        max_waiting_bytes: Most bytes the blocked requests of all clients
            may hold together (see the module).
        max_waited_keys: Most keys one ``WAIT`` may name; one naming more is
            refused.
        schedule: Given by a driver with an event loop, which then calls
            :meth:`work` as :mod:`rdzv.store.waiters` says; None: all at once.

    Raises:
        ValueError: ``max_waiting_bytes`` or ``max_waited_keys`` is not positive.
    """

    def __init__(
        self,
        max_waiting_bytes: int = DEFAULT_MAX_WAITING_BYTES,
        max_waited_keys: int = DEFAULT_MAX_WAITED_KEYS,
        schedule: Callable[[], None] | None = None,
    ) -> None:
        for name, limit in (
            ("max_waiting_bytes", max_waiting_bytes),
            ("max_waited_keys", max_waited_keys),
        ):
            if limit < 1:
                raise ValueError(f"{name} must be at least 1, got {limit}")
        self.max_waiting_bytes = max_waiting_bytes
        self.max_waited_keys = max_waited_keys
        self.reserved_bytes = 0
        """What :meth:`reserve_wait` set aside for ``WAIT`` s still arriving."""
        self._reserved: dict[ClientT, int] = {}
        self._data: dict[bytes, bytes | bytearray] = {}
        self._queues: dict[bytes, deque[bytes]] = {}
        self._waiters: WaiterIndex[ClientT] = WaiterIndex(self._exists, schedule)
        self._index = self._waiters.by_key
        self._blocked = self._waiters.blocked
        self.handlers: Mapping[int, Callable[[ClientT, Request], _Outcome[ClientT]]] = {
            op: MethodType(handler, self) for op, handler in _HANDLERS.items()
        }
        self._memo: tuple[bytes | bytearray, bytes] | None = None
        """The value last hashed by :meth:`_current_digest`, and its digest."""

    # -- the driver's interface ----------------------------------------------

    def apply(self, client: ClientT, request: Request) -> _Outcome[ClientT]:
        """Carry out ``client``'s ``request``, whose opcode is one of :attr:`handlers`.

        Return the reply to ``client`` (None when the request has no reply or
        is now blocked), and the ``(client, reply)`` pairs of the blocked
        requests of other clients that this request answered.

        Raises:
            ProtocolError: The request cannot be carried out; nothing changed.
        """
        handler = self.handlers.get(request.op)
        if handler is None:
            raise ProtocolError(f"opcode {request.op} is not a store operation")
        if self._blocked and request.op != Op.CANCEL_WAIT and client in self._blocked:
            raise ProtocolError(
                f"opcode {request.op} arrived while a request was blocked; "
                "only CANCEL_WAIT may follow it"
            )
        return handler(client, request)

    def set_many(self, pairs: Iterable[tuple[bytes, bytes]]) -> Woken[ClientT]:
        """Carry out a run of ``SET`` requests, in order (no reply is owed).

        The driver's fast path for sets that arrive back to back
        (:meth:`~rdzv.store.protocol.RequestParser.next_sets`): the same as
        :meth:`apply` of each, in one call. The caller checks that the client
        has no blocked request. Return the ``(client, reply)`` pairs of the
        blocked requests the sets answered.
        """
        if not self._index:
            self._data.update(pairs)
            return ()
        woken: list[tuple[ClientT, bytes]] = []
        for key, value in pairs:
            woken += self._write(key, value)
        return woken

    def drop(self, client: ClientT) -> bytes | None:
        """End the blocked request of ``client``; the engine answers nothing (see the module).

        Return the reply a timeout calls for (``GET_WAIT``: timed out,
        ``WATCH``: unchanged); None for a ``WAIT`` or ``BARRIER``, whose
        clients cancel, or when ``client`` has no blocked request.
        """
        if self._reserved:
            self._unreserve(client)
        waiter = self._blocked.get(client)
        if waiter is None:
            return None
        self._waiters.remove(waiter)
        return waiter.on_timeout

    def reserve_wait(self, client: ClientT, count: int) -> None:
        """Set aside the least a ``WAIT`` of ``count`` keys still arriving may hold.

        A driver that reads requests piecemeal calls this once the number of
        keys of a client's ``WAIT`` is known, so that many ``WAIT`` s arriving
        at once cannot each be read in full (the keys cost memory while they
        are read) before the budget refuses all but the first. The ``WAIT``
        itself (:meth:`apply`) or :meth:`drop` gives it back.

        Raises:
            ProtocolError: ``count`` keys would pass ``max_waiting_bytes`` or
                ``max_waited_keys``.
        """
        if self._reserved:
            self._unreserve(client)
        self._check_key_count(count)
        amount = WAITED_KEY_OVERHEAD * count
        self._check_budget(Op.WAIT, count, amount)
        self._reserved[client] = amount
        self.reserved_bytes += amount

    def _unreserve(self, client: ClientT) -> None:
        self.reserved_bytes -= self._reserved.pop(client, 0)

    def timeout_ms(self, client: ClientT) -> int | None:
        """Return after how many milliseconds the driver should :meth:`drop` ``client``'s request.

        None when it blocks until answered or cancelled (or is not blocked).
        """
        waiter = self._blocked.get(client)
        return None if waiter is None else waiter.timeout_ms

    @property
    def waiter_count(self) -> int:
        """The number of blocked requests."""
        return len(self._blocked)

    @property
    def indexed_keys(self) -> int:
        """The number of keys that blocked requests wait on (or whose entries are being cleared)."""
        return len(self._index)

    @property
    def waiting_bytes(self) -> int:
        """What the blocked requests hold, as counted against ``max_waiting_bytes``."""
        return self._waiters.waiting_bytes

    @property
    def waiter_checks(self) -> int:
        """How many times a write examined a blocked request, in total."""
        return self._waiters.checks

    @property
    def has_work(self) -> bool:
        """Whether large blocked requests are still being indexed or cleared (see :meth:`work`)."""
        return self._waiters.has_work

    def work(self) -> Woken[ClientT]:
        """Index or clear the next slice of large blocked requests.

        Only with ``schedule``, which tells the driver when to call this (then
        again while :attr:`has_work`). Return the ``(client, reply)`` pairs of
        the ``WAIT`` s it answered: those whose keys all existed once indexed.
        """
        return self._waiters.work()

    # -- the waiter index ------------------------------------------------------

    def _admit(self, op: Op, keys: Sequence[bytes]) -> int:
        """Return what a request blocked on ``keys`` would cost.

        Raises:
            ProtocolError: The cost would pass ``max_waiting_bytes``.
        """
        cost = sum(map(len, keys)) + WAITED_KEY_OVERHEAD * len(keys)
        self._check_budget(op, len(keys), cost)
        return cost

    def _check_key_count(self, count: int) -> None:
        if count > self.max_waited_keys:
            raise ProtocolError(
                f"WAIT of {count} keys is over the limit of {self.max_waited_keys} keys "
                "one client may wait on (max_waited_keys)"
            )

    def _check_budget(self, op: Op, count: int, cost: int) -> None:
        held = self.waiting_bytes + self.reserved_bytes
        if held + cost > self.max_waiting_bytes:
            raise ProtocolError(
                f"{op.name} of {count} keys would hold {cost} bytes while blocked, "
                f"{held} bytes held by blocked requests already: over the "
                f"limit of {self.max_waiting_bytes} bytes (max_waiting_bytes)"
            )

    def _notify(self, key: bytes, existence: int) -> Woken[ClientT]:
        """Answer the waiters of ``key`` that its change satisfied (see :meth:`WaiterIndex.notify`)."""
        if key not in self._index:
            return ()
        self._memo = None  # an appended value changes in place: hash afresh
        woken = self._waiters.notify(key, existence)
        self._memo = None
        return woken

    def _exists(self, key: bytes) -> bool:
        return key in self._data or key in self._queues

    def _write(self, key: bytes, value: bytes) -> Woken[ClientT]:
        """Store ``value`` under ``key`` and answer the waiters it satisfies.

        The hot handlers store directly while nothing is blocked at all.
        """
        if key in self._index:
            created = not self._exists(key)
            self._data[key] = value
            return self._notify(key, 1 if created else 0)
        self._data[key] = value
        return ()

    def _sum(self, key: bytes, amount: int) -> int:
        """Return the value of ``key`` plus ``amount``, as ``ADD`` computes it."""
        current = self._data.get(key)
        try:
            return amount if current is None else int(current) + amount
        except ValueError:
            raise ProtocolError(f"ADD to key {_show(key)}, whose value is not an integer") from None

    # -- torch's operations ----------------------------------------------------

    def _set(self, _client: ClientT, request: Request) -> _Outcome[ClientT]:
        if self._index:
            return None, self._write(request.keys[0], request.values[0])
        self._data[request.keys[0]] = request.values[0]
        return _NOTHING

    def _get(self, _client: ClientT, request: Request) -> _Outcome[ClientT]:
        return encode_bytes(self._data.get(request.keys[0], b"")), ()

    def _compare_set(self, _client: ClientT, request: Request) -> _Outcome[ClientT]:
        key = request.keys[0]
        expected, desired = request.values
        current = self._data.get(key)
        if current is None:
            if expected:
                return encode_bytes(expected), ()
        elif current != expected:
            return encode_bytes(current), ()
        if self._index:
            return encode_bytes(desired), self._write(key, desired)
        self._data[key] = desired
        return encode_bytes(desired), ()

    def _add_request(self, _client: ClientT, request: Request) -> _Outcome[ClientT]:
        key = request.keys[0]
        value = self._sum(key, request.number)
        if self._index:
            return encode_i64(value), self._write(key, str(value).encode())
        self._data[key] = str(value).encode()
        return encode_i64(value), ()

    def _check(self, _client: ClientT, request: Request) -> _Outcome[ClientT]:
        data, queues = self._data, self._queues
        ready = all(key in data or key in queues for key in request.keys)
        return (_READY if ready else _NOT_READY), ()

    def _wait(self, client: ClientT, request: Request) -> _Outcome[ClientT]:
        if self._reserved:
            self._unreserve(client)
        keys = request.keys
        self._check_key_count(len(keys))
        if len(keys) <= WAIT_SLICE:  # a large one is deduplicated as it is indexed, in slices
            data, queues = self._data, self._queues
            if all(key in data or key in queues for key in keys):
                return STOP_WAITING, ()
            keys = tuple(dict.fromkeys(keys))
        cost = self._admit(Op.WAIT, keys)
        if self._waiters.block(Waiter(client, keys), cost):
            return STOP_WAITING, ()
        return _NOTHING

    def _num_keys(self, _client: ClientT, _request: Request) -> _Outcome[ClientT]:
        return encode_i64(len(self._data)), ()

    def _delete_key(self, _client: ClientT, request: Request) -> _Outcome[ClientT]:
        key = request.keys[0]
        if self._data.pop(key, None) is None:
            return _ZERO, ()
        return _ONE, self._notify(key, 0 if key in self._queues else -1)

    def _append(self, _client: ClientT, request: Request) -> _Outcome[ClientT]:
        key, value = request.keys[0], request.values[0]
        current = self._data.get(key)
        size = len(value) if current is None else len(current) + len(value)
        if size > MAX_APPENDED_BYTES:
            raise ProtocolError(
                f"APPEND to key {_show(key)} would make its value {size} bytes long, "
                f"over the limit of {MAX_APPENDED_BYTES} bytes (MAX_APPENDED_BYTES)"
            )
        if current is None:
            return None, self._write(key, value)
        if isinstance(current, bytearray):
            current += value  # in place: the dict holds this bytearray
        else:
            self._data[key] = bytearray(current) + value
        return None, self._notify(key, 0)

    def _multi_get(self, _client: ClientT, request: Request) -> _Outcome[ClientT]:
        data = self._data
        values = [data.get(key, b"") for key in request.keys]
        _check_reply_size(Op.MULTI_GET, 8 * len(values) + sum(map(len, values)))
        return b"".join(map(encode_bytes, values)), ()

    def _multi_set(self, _client: ClientT, request: Request) -> _Outcome[ClientT]:
        return None, self.set_many(zip(request.keys, request.values, strict=True))

    def _cancel_wait(self, client: ClientT, _request: Request) -> _Outcome[ClientT]:
        self.drop(client)
        return _WAIT_CANCELED, ()

    def _queue_push(self, _client: ClientT, request: Request) -> _Outcome[ClientT]:
        key = request.keys[0]
        queue = self._queues.get(key)
        if queue is not None:
            queue.append(request.values[0])
            return _NOTHING
        created = key not in self._data
        self._queues[key] = deque((request.values[0],))
        return None, (self._notify(key, 1) if created else ())

    def _queue_pop(self, _client: ClientT, request: Request) -> _Outcome[ClientT]:
        key = request.keys[0]
        queue = self._queues.get(key)
        if queue is None:
            return _ZERO, ()
        reply = _ONE + encode_bytes(queue.popleft())
        if queue:
            return reply, ()
        del self._queues[key]
        return reply, (() if key in self._data else self._notify(key, -1))

    def _queue_len(self, _client: ClientT, request: Request) -> _Outcome[ClientT]:
        queue = self._queues.get(request.keys[0])
        return encode_i64(0 if queue is None else len(queue)), ()

    def _list_keys(self, _client: ClientT, _request: Request) -> _Outcome[ClientT]:
        keys = list(self._data)
        _check_reply_size(Op.LIST_KEYS, 8 + 8 * len(keys) + sum(map(len, keys)))
        return encode_i64(len(keys)) + b"".join(encode_bytes(key) for key in keys), ()

    def _barrier(self, client: ClientT, request: Request) -> _Outcome[ClientT]:
        key = request.keys[0]
        world_size = request.number
        data = self._data

        def arrived() -> bytes | None:
            try:
                count = int(data.get(key, b"0"))
            except ValueError:
                return None
            return STOP_WAITING if count >= world_size else None

        count = self._sum(key, 1)
        cost = 0 if count >= world_size else self._admit(Op.BARRIER, (key,))
        woken = self._write(key, str(count).encode())
        reply = arrived()
        if reply is None:
            self._waiters.block(Waiter(client, (key,), ready=arrived), cost)
        return reply, woken

    # -- rdzv's extensions -----------------------------------------------------

    def _get_wait(self, client: ClientT, request: Request) -> _Outcome[ClientT]:
        key = request.keys[0]
        data = self._data
        value = data.get(key)
        if value is not None:
            return _FOUND + encode_bytes(value), ()
        if request.number == 0:
            return _TIMED_OUT, ()

        def found() -> bytes | None:
            value = data.get(key)
            return None if value is None else _FOUND + encode_bytes(value)

        cost = self._admit(Op.GET_WAIT, (key,))
        self._waiters.block(
            Waiter(client, (key,), ready=found, timeout_ms=request.number, on_timeout=_TIMED_OUT),
            cost,
        )
        return _NOTHING

    def _watch(self, client: ClientT, request: Request) -> _Outcome[ClientT]:
        key = request.keys[0]
        previous = request.values[0] if request.values else None
        data = self._data

        def changed() -> bytes | None:
            current = data.get(key)
            if current == previous:
                return None
            return _WATCH_ABSENT if current is None else _WATCH_PRESENT + encode_bytes(current)

        reply = changed()
        if reply is not None:
            return reply, ()
        if request.number == 0:
            return _WATCH_UNCHANGED, ()
        cost = self._admit(Op.WATCH, (key,))
        if previous is not None and len(previous) > WATCH_DIGEST_PAST:
            changed = self._changed_from_digest(key, len(previous), _digest(previous))
        self._waiters.block(
            Waiter(
                client,
                (key,),
                ready=changed,
                timeout_ms=request.number,
                on_timeout=_WATCH_UNCHANGED,
            ),
            cost,
        )
        return _NOTHING

    def _changed_from_digest(
        self, key: bytes, size: int, digest: bytes
    ) -> Callable[[], bytes | None]:
        """The predicate of a ``WATCH`` of a long value, which holds its digest only."""
        data = self._data

        def changed() -> bytes | None:
            current = data.get(key)
            if current is None:
                return _WATCH_ABSENT
            if len(current) == size and self._current_digest(current) == digest:
                return None
            return _WATCH_PRESENT + encode_bytes(current)

        return changed

    def _current_digest(self, value: bytes | bytearray) -> bytes:
        """Return the digest of ``value``, the value of the key being notified.

        It is computed once per write, however many watchers compare it.
        """
        memo = self._memo
        if memo is not None and memo[0] is value:
            return memo[1]
        digest = _digest(value)
        self._memo = (value, digest)
        return digest

    def _multi_try_get(self, _client: ClientT, request: Request) -> _Outcome[ClientT]:
        data = self._data
        values = [data.get(key) for key in request.keys]
        size = sum(1 if value is None else 9 + len(value) for value in values)
        _check_reply_size(Op.MULTI_TRY_GET, size)
        return b"".join(
            _ABSENT if value is None else _PRESENT + encode_bytes(value) for value in values
        ), ()


_HANDLERS: dict[int, Callable[[StoreEngine[Any], Any, Request], _Outcome[Any]]] = {
    Op.SET: StoreEngine._set,
    Op.COMPARE_SET: StoreEngine._compare_set,
    Op.GET: StoreEngine._get,
    Op.ADD: StoreEngine._add_request,
    Op.CHECK: StoreEngine._check,
    Op.WAIT: StoreEngine._wait,
    Op.GETNUMKEYS: StoreEngine._num_keys,
    Op.DELETE_KEY: StoreEngine._delete_key,
    Op.APPEND: StoreEngine._append,
    Op.MULTI_GET: StoreEngine._multi_get,
    Op.MULTI_SET: StoreEngine._multi_set,
    Op.CANCEL_WAIT: StoreEngine._cancel_wait,
    Op.QUEUE_PUSH: StoreEngine._queue_push,
    Op.QUEUE_POP: StoreEngine._queue_pop,
    Op.QUEUE_LEN: StoreEngine._queue_len,
    Op.LIST_KEYS: StoreEngine._list_keys,
    Op.BARRIER: StoreEngine._barrier,
    Op.WATCH: StoreEngine._watch,
    Op.GET_WAIT: StoreEngine._get_wait,
    Op.MULTI_TRY_GET: StoreEngine._multi_try_get,
}
# Dict lookups hash ints faster than IntEnum members: key the table by int.
_HANDLERS = {int(op): handler for op, handler in _HANDLERS.items()}
