"""In-process stores: :class:`HashStore` and :class:`PrefixStore`."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TypeVar

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

__all__ = ["HashStore", "PrefixStore"]

_T = TypeVar("_T")


class HashStore(Store):
    """A thread-safe in-memory store, for one process.

    Args:
        timeout: The timeout of blocking operations.
    """

    def __init__(self, timeout: Timeout = DEFAULT_STORE_TIMEOUT) -> None:
        super().__init__(timeout)
        self._data: dict[str, bytes] = {}
        self._queues: dict[str, deque[bytes]] = {}
        self._changed = threading.Condition()

    @property
    def supports_watch(self) -> bool:
        """Always True: the in-memory store can watch keys."""
        return True

    def _wait_until(self, ready: Callable[[], _T | None], timeout: float, what: str) -> _T:
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                result = ready()
                if result is not None:
                    return result
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise StoreTimeoutError(f"timed out after {timeout:g} s waiting for {what}")
                self._changed.wait(remaining)

    def set(self, key: str, value: Value) -> None:  # noqa: D102 - documented on Store
        data = to_bytes(value)
        with self._changed:
            self._data[key] = data
            self._changed.notify_all()

    def get(self, key: str) -> bytes:  # noqa: D102
        return self._wait_until(
            lambda: self._data.get(key), self.timeout.total_seconds(), f"key {key!r}"
        )

    def add(self, key: str, amount: int) -> int:  # noqa: D102
        with self._changed:
            current = self._data.get(key, b"0")
            try:
                value = int(current) + int(amount)
            except ValueError:
                raise ValueError(
                    f"the value of key {key!r} is not an integer: {current!r}"
                ) from None
            self._data[key] = str(value).encode()
            self._changed.notify_all()
            return value

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:  # noqa: D102
        expected_b, desired_b = to_bytes(expected), to_bytes(desired)
        with self._changed:
            current = self._data.get(key)
            if current is None:
                if expected_b:
                    return expected_b
                self._data[key] = desired_b
                self._changed.notify_all()
                return desired_b
            if current == expected_b:
                self._data[key] = desired_b
                self._changed.notify_all()
                return desired_b
            return current

    def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None:  # noqa: D102
        seconds = self.timeout.total_seconds() if timeout is None else to_seconds(timeout)
        self._wait_until(
            lambda: True if all(k in self._data for k in keys) else None,
            seconds,
            f"keys {list(keys)!r}",
        )

    def check(self, keys: Sequence[str]) -> bool:  # noqa: D102
        with self._changed:
            return all(k in self._data for k in keys)

    def delete_key(self, key: str) -> bool:  # noqa: D102
        with self._changed:
            existed = self._data.pop(key, None) is not None
            if existed:
                self._changed.notify_all()
            return existed

    def num_keys(self) -> int:  # noqa: D102
        with self._changed:
            return len(self._data)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:  # noqa: D102
        self.wait(keys)
        with self._changed:
            return [self._data[k] for k in keys]

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:  # noqa: D102
        check_multi_set(keys, values)
        encoded = [to_bytes(v) for v in values]
        with self._changed:
            self._data.update(zip(keys, encoded, strict=True))
            self._changed.notify_all()

    def append(self, key: str, value: Value) -> None:  # noqa: D102
        data = to_bytes(value)
        with self._changed:
            self._data[key] = self._data.get(key, b"") + data
            self._changed.notify_all()

    def list_keys(self) -> list[str]:  # noqa: D102
        with self._changed:
            return list(self._data)

    def queue_push(self, key: str, value: Value) -> None:  # noqa: D102
        data = to_bytes(value)
        with self._changed:
            self._queues.setdefault(key, deque()).append(data)
            self._changed.notify_all()

    def queue_pop(self, key: str, block: bool = True) -> bytes:  # noqa: D102
        def pop() -> bytes | None:
            queue = self._queues.get(key)
            return queue.popleft() if queue else None

        timeout = self.timeout.total_seconds() if block else 0.0
        return self._wait_until(pop, timeout, f"an item in queue {key!r}")

    def queue_len(self, key: str) -> int:  # noqa: D102
        with self._changed:
            return len(self._queues.get(key, ()))

    def try_multi_get(self, keys: Sequence[str]) -> list[bytes | None]:  # noqa: D102
        with self._changed:
            return [self._data.get(k) for k in keys]

    def watch(self, key: str, previous: bytes | None, timeout: Timeout) -> bytes | None:  # noqa: D102
        deadline = time.monotonic() + to_seconds(timeout)
        with self._changed:
            while True:
                current = self._data.get(key)
                if current != previous:
                    return current
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return previous
                self._changed.wait(remaining)


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
        """Change the timeout of the underlying store.

        Args:
            timeout: A ``timedelta`` or seconds.
        """
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
