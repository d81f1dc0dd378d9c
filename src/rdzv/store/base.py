"""The key-value store API shared by every rdzv store.

The method names and semantics follow ``torch.distributed.Store`` so that code
written for torch ports by changing an import. Keys are ``str``; values are
``str`` or ``bytes`` going in and ``bytes`` coming out; timeouts accept a
:class:`datetime.timedelta` or a number of seconds.

A store that can block until a key changes also implements
:meth:`Store.watch`; callers test :attr:`Store.supports_watch` first.
"""

from __future__ import annotations

import math
import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol, Union

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "DEFAULT_STORE_TIMEOUT",
    "MAX_DURATION",
    "Stoppable",
    "Store",
    "StoreLike",
    "Timeout",
    "TorchStoreAPI",
    "Value",
    "check_multi_set",
    "to_bytes",
    "to_seconds",
]

Value = Union[str, bytes, bytearray, memoryview]  # noqa: UP007 - a runtime alias on 3.10
Timeout = Union[timedelta, float, int]  # noqa: UP007 - a runtime alias on 3.10

DEFAULT_STORE_TIMEOUT = timedelta(seconds=300)


class Stoppable(Protocol):
    """Something running in the background that ``stop()`` ends (:meth:`Store.keep_will`)."""

    def stop(self) -> None:
        """End it (idempotent)."""


# What Store.try_multi_get's default compares a key with: never stored (a
# compare_set with it writes nothing new), unknown to other processes.
_ABSENT = b"\x00rdzv-absent-" + secrets.token_bytes(16)


def to_bytes(value: Value) -> bytes:
    """Convert a store value to bytes (``str`` is encoded as UTF-8).

    Raises:
        TypeError: The value is neither ``str`` nor bytes-like.
    """
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"store values must be str or bytes, not {type(value).__name__}")


def check_multi_set(keys: Sequence[str], values: Sequence[Value]) -> None:
    """Check the arguments of :meth:`Store.multi_set`: as many values as keys.

    Raises:
        ValueError: They differ in length; the message gives both lengths.
    """
    if len(keys) != len(values):
        raise ValueError(
            f"multi_set got {len(keys)} keys but {len(values)} values; they must match"
        )


MAX_DURATION = 366 * 24 * 3600.0
"""The longest timeout or interval, in seconds (a year): longer ones are typos.

Past a few hundred years a timeout no longer fits the system calls that
carry it (a socket's timeout, a request's milliseconds); a year is far
below that and far above any wait a rendezvous or a store has."""


def to_seconds(timeout: Timeout, name: str = "timeout") -> float:
    """Convert a timeout given as ``timedelta`` or seconds to seconds, at most :data:`MAX_DURATION`.

    ``name`` is the parameter's name in error messages.

    Raises:
        ValueError: The timeout is negative, not finite or over a year.
        TypeError: The timeout is not a ``timedelta`` or a number.
    """
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"{name} must be a timedelta or seconds, not {type(timeout).__name__}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{name} must be a finite non-negative duration, got {timeout!r}")
    if seconds > MAX_DURATION:
        raise ValueError(f"{name} must be at most {MAX_DURATION:g} s (a year), got {timeout!r}")
    return seconds


class Store(ABC):
    """A key-value store with torch's ``Store`` semantics.

    Blocking calls (:meth:`get`, :meth:`wait`, :meth:`multi_get`) give up
    after the store timeout and raise :class:`rdzv.StoreTimeoutError`; a store
    whose server is unreachable raises :class:`rdzv.RendezvousConnectionError`.
    """

    def __init__(self, timeout: Timeout = DEFAULT_STORE_TIMEOUT) -> None:
        self._timeout = timedelta(seconds=to_seconds(timeout))

    @property
    def timeout(self) -> timedelta:
        """The timeout applied to blocking operations."""
        return self._timeout

    def set_timeout(self, timeout: Timeout) -> None:
        """Change the timeout applied to blocking operations (a ``timedelta`` or seconds).

        Raises:
            ValueError: The timeout is negative or not finite.
        """
        self._timeout = timedelta(seconds=to_seconds(timeout))

    @property
    def supports_watch(self) -> bool:
        """Whether :meth:`watch` blocks on the server instead of raising."""
        return False

    def keep_will(
        self, key: str, value: Value, on_restored: Callable[[], None]
    ) -> Stoppable | None:
        """Have the server set ``key`` to ``value`` as soon as this process dies.

        None when this store cannot (the default: only rdzv's TCP server
        holds wills). Otherwise a handle whose ``stop()`` withdraws it;
        ``on_restored`` is called when the will had to be made again on a
        new connection (see :mod:`rdzv.store.will`).
        """
        return None

    @abstractmethod
    def set(self, key: str, value: Value) -> None:
        """Store ``value`` under ``key``, waking anyone waiting for the key."""

    @abstractmethod
    def get(self, key: str) -> bytes:
        """Return the value of ``key``, waiting up to the store timeout for it to exist.

        Raises:
            StoreTimeoutError: The key did not appear within the timeout.
        """

    @abstractmethod
    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` (possibly negative) to the integer under ``key`` (0 when missing).

        The value is kept as ASCII decimal; the new value is returned.

        Raises:
            ValueError: The stored value is not an integer.
        """

    @abstractmethod
    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        """Set ``key`` to ``desired`` if its value equals ``expected``.

        torch's rules for a missing key: with an empty ``expected`` the key is
        created with ``desired`` and ``desired`` is returned; with a non-empty
        ``expected`` nothing is written and ``expected`` is returned. Otherwise
        the value of the key after the operation is returned.
        """

    @abstractmethod
    def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None:
        """Block until every key exists; ``timeout`` overrides the store timeout.

        Raises:
            StoreTimeoutError: Not every key existed within the timeout.
        """

    @abstractmethod
    def check(self, keys: Sequence[str]) -> bool:
        """Tell whether every key exists, without waiting."""

    @abstractmethod
    def delete_key(self, key: str) -> bool:
        """Delete ``key``; return whether it existed."""

    @abstractmethod
    def num_keys(self) -> int:
        """Return the number of keys in the store."""

    @abstractmethod
    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """Return the values of several keys, in order, waiting for all of them to exist.

        Raises:
            StoreTimeoutError: Not every key existed within the store timeout.
        """

    @abstractmethod
    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        """Set several keys at once to their ``values``.

        Raises:
            ValueError: ``keys`` and ``values`` differ in length.
        """

    @abstractmethod
    def append(self, key: str, value: Value) -> None:
        """Append ``value`` to the value of ``key`` (creating it when missing)."""

    @abstractmethod
    def list_keys(self) -> list[str]:
        """Return every key in the store."""

    @abstractmethod
    def queue_push(self, key: str, value: Value) -> None:
        """Push ``value`` onto the queue named ``key``."""

    @abstractmethod
    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """Pop the oldest item of the queue named ``key``.

        With ``block``, wait up to the store timeout for an item when the
        queue is empty.

        Raises:
            StoreTimeoutError: The queue stayed empty within the timeout (or
                was empty and ``block`` is False).
        """

    @abstractmethod
    def queue_len(self, key: str) -> int:
        """Return the number of items in the queue named ``key`` (0 when it does not exist)."""

    def try_multi_get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Return the values of several keys without waiting; None for a missing key.

        This default needs only torch's ``Store`` API (a torch store behind
        :class:`~rdzv.store.foreign.ForeignStore`, rdzv's client of torch's
        server): it reads each key with ``compare_set(key, probe, probe)``,
        ``probe`` being random bytes of this process that no stored value
        equals. torch's rule for a missing key with a non-empty expected
        value returns the expected value and writes nothing, and a present
        key returns its value: one atomic read of one key that never waits
        (``check`` then ``multi_get`` would wait the store's whole timeout
        for a key deleted between the two). The keys are read one after the
        other, in the order given, so the values are no snapshot of one
        instant but each is read after the one before. Stores that read
        several keys at once override it.
        """
        found: list[bytes | None] = []
        for key in keys:
            raw = self.compare_set(key, _ABSENT, _ABSENT)
            found.append(None if raw == _ABSENT else raw)
        return found

    def watch(self, key: str, previous: bytes | None, timeout: Timeout) -> bytes | None:
        """Block until the value of ``key`` differs from ``previous`` (None: absent).

        Return the new value (None if the key is absent), or ``previous`` if
        it did not change within ``timeout``.

        Raises:
            NotImplementedError: This store cannot watch (see
                :attr:`supports_watch`).
        """
        raise NotImplementedError(f"{type(self).__name__} does not support watch")

    def close(self) -> None:  # noqa: B027 - optional hook with a no-op default
        """Release the store's connections; the default does nothing."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class TorchStoreAPI(Protocol):
    """The part of ``torch.distributed.Store`` that torch's type stubs declare and rdzv calls."""

    def set(self, key: str, value: str, /) -> None: ...  # noqa: D102
    def get(self, key: str, /) -> bytes: ...  # noqa: D102
    def add(self, key: str, value: int, /) -> int: ...  # noqa: D102
    def check(self, keys: list[str], /) -> bool: ...  # noqa: D102
    def compare_set(self, key: str, expected: str, desired: str, /) -> bytes: ...  # noqa: D102
    def delete_key(self, key: str, /) -> bool: ...  # noqa: D102
    def multi_get(self, keys: list[str], /) -> list[bytes]: ...  # noqa: D102
    def num_keys(self) -> int: ...  # noqa: D102
    def set_timeout(self, timeout: timedelta, /) -> None: ...  # noqa: D102
    def list_keys(self) -> list[str]: ...  # noqa: D102


StoreLike = Union[Store, TorchStoreAPI]  # noqa: UP007 - a runtime alias on 3.10
"""What rdzv takes as a store: an rdzv store, or one with torch's ``Store`` API."""
