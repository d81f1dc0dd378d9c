"""rdzv's stores as real ``torch.distributed.Store`` objects (the ``rdzv[torch]`` extra).

``RendezvousInfo.store`` and the store of every ``create_backend`` are rdzv
stores; :func:`as_torch_store` makes any of them a ``torch.distributed.Store``,
so ``torch.distributed.init_process_group(store=as_torch_store(info.store),
...)`` works. The adapter subclasses torch's ``Store`` in Python and forwards
every call to the rdzv store, so a prefix store keeps its prefix, and an
authenticated or TLS TCP store, a file store, an etcd or a Redis store work
the same way. ``get`` and ``wait`` without a timeout use the adapter's
timeout (``set_timeout``; the rdzv store's at first), as torch's stores do.
rdzv's timeouts become torch's ``DistStoreError`` and its connection errors
``DistNetworkError`` (:func:`dist_errors`).

torch 2.13 forwards ``set``, ``get``, ``add``, ``compare_set``, ``check``,
``wait``, ``append``, ``multi_get`` and ``multi_set`` of a Python store to
Python when C++ calls them (``ProcessGroupGloo``, torch's ``PrefixStore``),
which is what process groups use; ``delete_key``, ``num_keys``,
``list_keys`` and the queue calls reach the adapter from Python only.

This module imports torch only when first used: ``import rdzv.torch`` is
cheap, and the rest of rdzv never imports it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING

from rdzv import errors
from rdzv.store.base import Store, StoreLike, Value

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store as TorchStore

__all__ = ["as_torch_store", "dist_errors"]


@contextlib.contextmanager
def dist_errors() -> Iterator[None]:
    """Raise rdzv's store errors as torch's.

    Timeouts become ``torch.distributed.DistStoreError``, lost connections
    ``DistNetworkError`` and the other rendezvous errors ``DistError``.
    """
    import torch.distributed as dist  # noqa: PLC0415 - torch is optional

    try:
        yield
    except errors.RendezvousTimeoutError as exc:
        raise dist.DistStoreError(str(exc)) from exc
    except errors.RendezvousConnectionError as exc:
        raise dist.DistNetworkError(str(exc)) from exc
    except errors.RendezvousError as exc:
        raise dist.DistError(str(exc)) from exc


def as_torch_store(store: StoreLike) -> TorchStore:
    """Return ``store`` as a ``torch.distributed.Store``.

    An rdzv store gets an adapter: its calls go to ``store``, and its
    ``rdzv_store`` attribute is ``store``. A torch store (``info.store`` of
    a handler given one) is returned as it is, so
    ``as_torch_store(info.store)`` works whichever store the handler got.

    Raises:
        TypeError: ``store`` is neither an rdzv store nor a torch store.
        ModuleNotFoundError: torch is not installed (``pip install 'rdzv[torch]'``).
    """
    if isinstance(store, Store):
        return _adapter_class()(store)
    from torch._C._distributed_c10d import Store as TorchStoreBase  # noqa: PLC0415

    if isinstance(store, TorchStoreBase):
        return store
    raise TypeError(
        f"as_torch_store takes an rdzv Store or a torch.distributed.Store, "
        f"got {type(store).__name__}"
    )


@functools.cache
def _adapter_class() -> Callable[[Store], TorchStore]:
    """Define the adapter class (it subclasses torch's ``Store``, so only on first use)."""
    from torch._C._distributed_c10d import Store as TorchStoreBase  # noqa: PLC0415

    class RdzvTorchStore(TorchStoreBase):
        """A ``torch.distributed.Store`` over an rdzv :class:`~rdzv.store.base.Store`.

        Args:
            inner: The rdzv store.
        """

        def __init__(self, inner: Store) -> None:
            super().__init__()
            self.rdzv_store = inner
            self._timeout = inner.timeout
            self.set_timeout(inner.timeout)

        def set_timeout(self, timeout: timedelta) -> None:
            super().set_timeout(timeout)
            self._timeout = timeout

        def set(self, key: str, value: Value) -> None:
            with dist_errors():
                self.rdzv_store.set(key, value)

        def get(self, key: str) -> bytes:
            with dist_errors():
                self.rdzv_store.wait([key], self._timeout)
                return self.rdzv_store.get(key)

        def add(self, key: str, value: int) -> int:
            with dist_errors():
                return self.rdzv_store.add(key, value)

        def compare_set(self, key: str, expected_value: Value, desired_value: Value) -> bytes:
            with dist_errors():
                return self.rdzv_store.compare_set(key, expected_value, desired_value)

        def check(self, keys: list[str]) -> bool:
            with dist_errors():
                return self.rdzv_store.check(keys)

        def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
            with dist_errors():
                self.rdzv_store.wait(keys, self._timeout if timeout is None else timeout)

        def delete_key(self, key: str) -> bool:
            with dist_errors():
                return self.rdzv_store.delete_key(key)

        def num_keys(self) -> int:
            with dist_errors():
                return self.rdzv_store.num_keys()

        def append(self, key: str, value: Value) -> None:
            with dist_errors():
                self.rdzv_store.append(key, value)

        def multi_get(self, keys: list[str]) -> list[bytes]:
            with dist_errors():
                self.rdzv_store.wait(keys, self._timeout)
                return self.rdzv_store.multi_get(keys)

        def multi_set(self, keys: list[str], values: list[Value]) -> None:
            with dist_errors():
                self.rdzv_store.multi_set(keys, values)

        def list_keys(self) -> list[str]:
            with dist_errors():
                return self.rdzv_store.list_keys()

        def queue_push(self, key: str, value: Value) -> None:
            with dist_errors():
                self.rdzv_store.queue_push(key, value)

        def queue_pop(self, key: str, block: bool = True) -> bytes:
            with dist_errors():
                return self.rdzv_store.queue_pop(key, block)

        def queue_len(self, key: str) -> int:
            with dist_errors():
                return self.rdzv_store.queue_len(key)

        def __repr__(self) -> str:
            return f"as_torch_store({self.rdzv_store!r})"

    return RdzvTorchStore
