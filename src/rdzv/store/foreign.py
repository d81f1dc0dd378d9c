"""Any store with torch's ``Store`` API as an rdzv :class:`~rdzv.store.base.Store`.

rdzv takes a store in a few places: the c10d backend, the join-queue and
liveness capabilities, the dynamic handler, ``rdzv status``. Each calls
:func:`as_store` once, where the store comes in: an rdzv store is used as it
is; any other object with torch's ``Store`` API (``torch.distributed``'s
``HashStore``, ``TCPStore``, ``FileStore``, ``PrefixStore``, a Python
subclass of its ``Store``) is wrapped in a :class:`ForeignStore`. Nothing
below that point asks again which kind of store it holds, and nothing here
imports torch: a foreign store is recognised by not being an rdzv store and
by having the methods rdzv calls.

What torch's ``Store`` lacks and what stands in for it:

* ``try_multi_get`` (read without waiting, None for a missing key) is
  :meth:`Store.try_multi_get <rdzv.store.base.Store.try_multi_get>`'s
  default, which needs only torch's API: one ``compare_set`` per key that
  neither writes nor waits, the keys read one after the other in the order
  given (the c10d backend reads a state body before its head for that
  reason; see :mod:`rdzv.backends.store`).
* ``watch``: none (``supports_watch`` is False), so rdzv's callers poll.
* errors: a timeout of a waiting call (torch's ``DistStoreError``, its
  ``QueueEmptyError``, ``FileStore``'s ``RuntimeError``) becomes
  :class:`~rdzv.errors.StoreTimeoutError` naming the keys; a lost
  connection (``DistNetworkError``) becomes
  :class:`~rdzv.errors.RendezvousConnectionError`; ``add`` to a value that
  is no integer is a ``ValueError`` that says so. Anything else is raised
  as torch raised it.
* ``close`` does nothing: the caller owns a store it built (torch's stores
  have no ``close``).

Queue calls are forwarded: a store without queues (torch's ``FileStore``,
its legacy TCP server) raises ``NotImplementedError``; rdzv's rendezvous
needs none.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

from rdzv.errors import RendezvousConnectionError, StoreTimeoutError
from rdzv.store.base import (
    Store,
    StoreLike,
    Timeout,
    TorchStoreAPI,
    Value,
    check_multi_set,
    to_bytes,
    to_seconds,
)
from rdzv.store.memory import PrefixStore

__all__ = ["ForeignStore", "StoreLike", "TorchStoreAPI", "as_store", "caller_view"]

_T = TypeVar("_T")

# What a foreign store must have (torch's Store API as rdzv calls it).
_REQUIRED = (
    "set",
    "get",
    "add",
    "compare_set",
    "check",
    "wait",
    "delete_key",
    "num_keys",
    "multi_get",
    "multi_set",
    "append",
    "list_keys",
    "set_timeout",
    "timeout",
)


def as_store(store: StoreLike) -> Store:
    """Return ``store`` as an rdzv store: itself, or a :class:`ForeignStore` around it.

    Raises:
        TypeError: ``store`` is no rdzv store and lacks part of torch's
            ``Store`` API; the message names what it lacks.
    """
    if isinstance(store, Store):
        return store
    missing = [name for name in _REQUIRED if not hasattr(store, name)]
    if missing:
        raise TypeError(
            f"{type(store).__name__} is neither an rdzv Store nor a store with torch's "
            f"Store API: it lacks {', '.join(missing)}"
        )
    return ForeignStore(store)


def caller_view(store: Store) -> Callable[[str], StoreLike]:
    """Return how a round's store is handed to the caller who gave ``store``.

    A caller who gave a ``torch.distributed.Store`` gets back what torch
    gives: a torch ``PrefixStore`` over that very store, which torch's APIs
    (``init_process_group(store=...)``) take as they are. Any other caller
    gets rdzv's :class:`~rdzv.store.memory.PrefixStore` over ``store``. Both
    prefix a key as ``<prefix>/<key>``, so the two views hold the same keys.
    The kind is decided here, once; torch is found among the modules already
    imported (a torch store implies it), never imported.
    """
    inner = store.inner if isinstance(store, ForeignStore) else None
    torch_distributed = sys.modules.get("torch.distributed")
    if torch_distributed is not None and isinstance(inner, torch_distributed.Store):
        make: Callable[[str, Any], StoreLike] = torch_distributed.PrefixStore
        return lambda prefix: make(prefix, inner)
    return lambda prefix: PrefixStore(prefix, store)


def _translated(exc: Exception, waited_for: Sequence[str] | None) -> Exception | None:
    """Return rdzv's error for a foreign store's ``exc``, or None to raise it as it is.

    ``waited_for``: the keys of a call that waits (None for the others).
    torch's error classes are recognised by name: the core imports no torch.
    """
    kinds = {cls.__name__ for cls in type(exc).__mro__}
    if "DistNetworkError" in kinds:
        return RendezvousConnectionError(f"the store lost its connection: {exc}")
    timed_out = "DistStoreError" in kinds or (
        isinstance(exc, RuntimeError) and "timeout" in str(exc).lower()
    )
    if waited_for is not None and timed_out:
        return StoreTimeoutError(f"timed out waiting for {list(waited_for)!r}: {exc}")
    return None


class ForeignStore(Store):
    """A store with torch's ``Store`` API behind rdzv's :class:`~rdzv.store.base.Store`.

    Built by :func:`as_store`; see the module for what stands in for what
    torch's API lacks.

    Args:
        inner: The store (a ``torch.distributed.Store``, usually).
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        super().__init__(inner.timeout)

    @property
    def inner(self) -> Any:
        """The store wrapped (the caller's)."""
        return self._inner

    @property
    def timeout(self) -> timedelta:
        """The foreign store's timeout."""
        value: timedelta = self._inner.timeout
        return value

    def set_timeout(self, timeout: Timeout) -> None:
        """Change the foreign store's timeout (a ``timedelta`` or seconds)."""
        self._inner.set_timeout(timedelta(seconds=to_seconds(timeout)))

    def _call(self, call: Callable[[], _T], waited_for: Sequence[str] | None = None) -> _T:
        try:
            return call()
        except Exception as exc:
            translated = _translated(exc, waited_for)
            if translated is None:
                raise
            raise translated from exc

    def set(self, key: str, value: Value) -> None:  # noqa: D102 - documented on Store
        self._call(lambda: self._inner.set(key, to_bytes(value)))

    def get(self, key: str) -> bytes:  # noqa: D102
        return bytes(self._call(lambda: self._inner.get(key), [key]))

    def add(self, key: str, amount: int) -> int:  # noqa: D102
        try:
            return int(self._call(lambda: self._inner.add(key, amount)))
        except ValueError as exc:
            raise ValueError(f"the value of key {key!r} is not an integer: {exc}") from exc

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:  # noqa: D102
        old, new = to_bytes(expected), to_bytes(desired)
        return bytes(self._call(lambda: self._inner.compare_set(key, old, new)))

    def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None:  # noqa: D102
        names = list(keys)
        if timeout is None:
            self._call(lambda: self._inner.wait(names), names)
        else:
            bound = timedelta(seconds=to_seconds(timeout))
            self._call(lambda: self._inner.wait(names, bound), names)

    def check(self, keys: Sequence[str]) -> bool:  # noqa: D102
        return bool(self._call(lambda: self._inner.check(list(keys))))

    def delete_key(self, key: str) -> bool:  # noqa: D102
        return bool(self._call(lambda: self._inner.delete_key(key)))

    def num_keys(self) -> int:  # noqa: D102
        return int(self._call(self._inner.num_keys))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:  # noqa: D102
        names = list(keys)
        return [bytes(v) for v in self._call(lambda: self._inner.multi_get(names), names)]

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:  # noqa: D102
        check_multi_set(keys, values)
        data = [to_bytes(v) for v in values]
        self._call(lambda: self._inner.multi_set(list(keys), data))

    def append(self, key: str, value: Value) -> None:  # noqa: D102
        self._call(lambda: self._inner.append(key, to_bytes(value)))

    def list_keys(self) -> list[str]:  # noqa: D102
        return list(self._call(self._inner.list_keys))

    def queue_push(self, key: str, value: Value) -> None:  # noqa: D102
        self._call(lambda: self._inner.queue_push(key, to_bytes(value)))

    def queue_pop(self, key: str, block: bool = True) -> bytes:  # noqa: D102
        return bytes(self._call(lambda: self._inner.queue_pop(key, block), [key]))

    def queue_len(self, key: str) -> int:  # noqa: D102
        return int(self._call(lambda: self._inner.queue_len(key)))

    def __repr__(self) -> str:
        return f"ForeignStore({self._inner!r})"
