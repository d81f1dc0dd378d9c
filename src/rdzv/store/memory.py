"""In-process stores: :class:`HashStore` and :class:`PrefixStore`."""

from __future__ import annotations

import math
import struct
import threading
import time
from collections.abc import Sequence
from datetime import timedelta

from rdzv.errors import StoreTimeoutError
from rdzv.store.base import (
    DEFAULT_STORE_TIMEOUT,
    Store,
    Timeout,
    Value,
    check_multi_set,
    to_bytes,
    to_seconds,
)
from rdzv.store.engine import StoreEngine
from rdzv.store.protocol import CheckResult, GetWaitStatus, Op, ProtocolError, Request, WatchStatus

__all__ = ["HashStore", "PrefixStore"]

_I64 = struct.Struct("<q")
_LENGTH = struct.Struct("<Q")


def _whole(reply: bytes | None) -> bytes:
    assert reply is not None, "a request that always has a reply had none"
    return reply


def _number(reply: bytes | None) -> int:
    """Decode a reply that is one ``i64``."""
    number: int = _I64.unpack(_whole(reply))[0]
    return number


def _value_at(reply: bytes, pos: int) -> tuple[bytes, int]:
    """Decode the length-prefixed value at ``pos``; return it and where it ends."""
    end = pos + 8 + _LENGTH.unpack_from(reply, pos)[0]
    return reply[pos + 8 : end], end


def _key(key: str) -> bytes:
    return key.encode("utf-8")


def _ms(seconds: float) -> int:
    """A request's own timeout: 0 answers at once, anything longer blocks."""
    return max(1, math.ceil(seconds * 1000)) if seconds > 0 else 0


class HashStore(Store):
    """A thread-safe in-memory store, for one process.

    It runs the :class:`~rdzv.store.engine.StoreEngine` of the TCP store
    server behind one lock, so the two answer every request alike. A call
    that blocks waits on a condition until a write by another thread hands
    it its reply, or until its timeout.

    Args:
        timeout: The timeout of blocking operations.
    """

    def __init__(self, timeout: Timeout = DEFAULT_STORE_TIMEOUT) -> None:
        super().__init__(timeout)
        self._engine: StoreEngine[object] = StoreEngine()
        self._changed = threading.Condition()
        self._replies: dict[object, bytes] = {}
        self._caller = object()
        """The client of every request that cannot block."""

    @property
    def supports_watch(self) -> bool:
        """Always True: the in-memory store can watch keys."""
        return True

    def _submit(self, client: object, request: Request) -> bytes | None:
        """Apply ``request`` (lock held) and hand the woken clients their replies."""
        try:
            reply, woken = self._engine.apply(client, request)
        except ProtocolError as exc:
            raise ValueError(str(exc)) from None
        if woken:
            self._replies.update(woken)
            self._changed.notify_all()
        return reply

    def _apply(self, request: Request) -> bytes | None:
        with self._changed:
            return self._submit(self._caller, request)

    def _block(self, request: Request, seconds: float) -> bytes | None:
        """Apply a request that may block, and wait up to ``seconds`` for its reply.

        Once the time ran out, return the engine's timeout reply (None for ``WAIT``).
        """
        client = object()
        deadline = time.monotonic() + seconds
        with self._changed:
            reply = self._submit(client, request)
            if reply is not None:
                return reply
            try:
                while (reply := self._replies.pop(client, None)) is None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return self._engine.drop(client)
                    self._changed.wait(remaining)
                return reply
            finally:
                # Nothing of an interrupted wait stays behind.
                self._engine.drop(client)
                self._replies.pop(client, None)

    def set(self, key: str, value: Value) -> None:  # noqa: D102 - documented on Store
        self._apply(Request(Op.SET, (_key(key),), (to_bytes(value),)))

    def get(self, key: str) -> bytes:  # noqa: D102
        seconds = self.timeout.total_seconds()
        reply = _whole(self._block(Request(Op.GET_WAIT, (_key(key),), (), _ms(seconds)), seconds))
        if reply[0] != GetWaitStatus.FOUND:
            raise StoreTimeoutError(f"timed out after {seconds:g} s waiting for key {key!r}")
        return _value_at(reply, 1)[0]

    def add(self, key: str, amount: int) -> int:  # noqa: D102
        return _number(self._apply(Request(Op.ADD, (_key(key),), (), int(amount))))

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:  # noqa: D102
        values = (to_bytes(expected), to_bytes(desired))
        return _value_at(_whole(self._apply(Request(Op.COMPARE_SET, (_key(key),), values))), 0)[0]

    def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None:  # noqa: D102
        seconds = self.timeout.total_seconds() if timeout is None else to_seconds(timeout)
        if self._block(Request(Op.WAIT, tuple(map(_key, keys))), seconds) is None:
            raise StoreTimeoutError(
                f"timed out after {seconds:g} s waiting for keys {list(keys)!r}"
            )

    def check(self, keys: Sequence[str]) -> bool:  # noqa: D102
        reply = _whole(self._apply(Request(Op.CHECK, tuple(map(_key, keys)))))
        return reply[0] == CheckResult.READY

    def delete_key(self, key: str) -> bool:  # noqa: D102
        return _number(self._apply(Request(Op.DELETE_KEY, (_key(key),)))) > 0

    def num_keys(self) -> int:  # noqa: D102
        return _number(self._apply(Request(Op.GETNUMKEYS)))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:  # noqa: D102
        self.wait(keys)
        reply = _whole(self._apply(Request(Op.MULTI_GET, tuple(map(_key, keys)))))
        values, pos = [], 0
        for _ in keys:
            value, pos = _value_at(reply, pos)
            values.append(value)
        return values

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:  # noqa: D102
        check_multi_set(keys, values)
        wire = tuple(map(_key, keys))
        self._apply(Request(Op.MULTI_SET, wire, tuple(map(to_bytes, values))))

    def append(self, key: str, value: Value) -> None:  # noqa: D102
        self._apply(Request(Op.APPEND, (_key(key),), (to_bytes(value),)))

    def list_keys(self) -> list[str]:  # noqa: D102
        reply = _whole(self._apply(Request(Op.LIST_KEYS)))
        keys, pos = [], 8
        for _ in range(_number(reply[:8])):
            key, pos = _value_at(reply, pos)
            keys.append(key.decode("utf-8"))
        return keys

    def queue_push(self, key: str, value: Value) -> None:  # noqa: D102
        self._apply(Request(Op.QUEUE_PUSH, (_key(key),), (to_bytes(value),)))

    def queue_pop(self, key: str, block: bool = True) -> bytes:  # noqa: D102
        wire = (_key(key),)
        seconds = self.timeout.total_seconds()
        deadline = time.monotonic() + seconds
        while True:
            reply = _whole(self._apply(Request(Op.QUEUE_POP, wire)))
            if _number(reply[:8]) > 0:
                return _value_at(reply, 8)[0]
            remaining = deadline - time.monotonic()
            if (
                not block
                or remaining <= 0
                or self._block(Request(Op.WAIT, wire), remaining) is None
            ):
                raise StoreTimeoutError(
                    f"timed out after {seconds if block else 0:g} s waiting for an item in "
                    f"queue {key!r}"
                )

    def queue_len(self, key: str) -> int:  # noqa: D102
        return _number(self._apply(Request(Op.QUEUE_LEN, (_key(key),))))

    def try_multi_get(self, keys: Sequence[str]) -> list[bytes | None]:  # noqa: D102
        reply = _whole(self._apply(Request(Op.MULTI_TRY_GET, tuple(map(_key, keys)))))
        values: list[bytes | None] = []
        pos = 0
        for _ in keys:
            if reply[pos]:
                value, pos = _value_at(reply, pos + 1)
                values.append(value)
            else:
                values.append(None)
                pos += 1
        return values

    def watch(self, key: str, previous: bytes | None, timeout: Timeout) -> bytes | None:  # noqa: D102
        seconds = to_seconds(timeout)
        values = () if previous is None else (previous,)
        request = Request(Op.WATCH, (_key(key),), values, _ms(seconds))
        reply = _whole(self._block(request, seconds))
        if reply[0] == WatchStatus.PRESENT:
            return _value_at(reply, 1)[0]
        return None if reply[0] == WatchStatus.ABSENT else previous


class PrefixStore(Store):
    """A view of another store in which every key is prefixed with ``prefix/``.

    Args:
        prefix: The prefix; the separator ``/`` is added.
        store: The underlying store. Its timeout is used.
    """

    def __init__(self, prefix: str, store: Store) -> None:
        super().__init__(store.timeout)
        self._prefix = prefix
        self._store = store

    @property
    def prefix(self) -> str:
        """The prefix, without the trailing separator."""
        return self._prefix

    @property
    def underlying_store(self) -> Store:
        """The store this view writes to."""
        return self._store

    @property
    def timeout(self) -> timedelta:
        """The timeout of the underlying store."""
        return self._store.timeout

    def set_timeout(self, timeout: Timeout) -> None:
        """Change the timeout of the underlying store (a ``timedelta`` or seconds)."""
        self._store.set_timeout(timeout)

    @property
    def supports_watch(self) -> bool:
        """Whether the underlying store can watch."""
        return self._store.supports_watch

    def _k(self, key: str) -> str:
        return f"{self._prefix}/{key}"

    def set(self, key: str, value: Value) -> None:  # noqa: D102
        self._store.set(self._k(key), value)

    def get(self, key: str) -> bytes:  # noqa: D102
        return self._store.get(self._k(key))

    def add(self, key: str, amount: int) -> int:  # noqa: D102
        return self._store.add(self._k(key), amount)

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:  # noqa: D102
        return self._store.compare_set(self._k(key), expected, desired)

    def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None:  # noqa: D102
        self._store.wait([self._k(k) for k in keys], timeout)

    def check(self, keys: Sequence[str]) -> bool:  # noqa: D102
        return self._store.check([self._k(k) for k in keys])

    def delete_key(self, key: str) -> bool:  # noqa: D102
        return self._store.delete_key(self._k(key))

    def num_keys(self) -> int:
        """Return the number of keys of the underlying store (as torch does)."""
        return self._store.num_keys()

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:  # noqa: D102
        return self._store.multi_get([self._k(k) for k in keys])

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:  # noqa: D102
        self._store.multi_set([self._k(k) for k in keys], values)

    def append(self, key: str, value: Value) -> None:  # noqa: D102
        self._store.append(self._k(key), value)

    def list_keys(self) -> list[str]:
        """Return the keys under this prefix, with the prefix removed."""
        head = f"{self._prefix}/"
        return [k[len(head) :] for k in self._store.list_keys() if k.startswith(head)]

    def queue_push(self, key: str, value: Value) -> None:  # noqa: D102
        self._store.queue_push(self._k(key), value)

    def queue_pop(self, key: str, block: bool = True) -> bytes:  # noqa: D102
        return self._store.queue_pop(self._k(key), block)

    def queue_len(self, key: str) -> int:  # noqa: D102
        return self._store.queue_len(self._k(key))

    def try_multi_get(self, keys: Sequence[str]) -> list[bytes | None]:  # noqa: D102
        return self._store.try_multi_get([self._k(k) for k in keys])

    def watch(self, key: str, previous: bytes | None, timeout: Timeout) -> bytes | None:  # noqa: D102
        return self._store.watch(self._k(key), previous, timeout)

    def close(self) -> None:
        """Close the underlying store."""
        self._store.close()
