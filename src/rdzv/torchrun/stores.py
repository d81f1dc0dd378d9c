"""The ``torch.distributed.Store`` torch's agent gets from every round.

torch's agent needs a real ``torch.distributed.Store`` from every round (it
assigns worker ranks and runs its exit barrier through it). One of three
:class:`_RoundStores` strategies gives it:

* ``rdzv`` (TCP store), :class:`_SharedServerStores`: a stock
  ``torch.distributed.TCPStore`` client connected to the rdzv server (which
  runs in a child process, see :mod:`rdzv.torchrun.server_child`), under the
  round's prefix (``rdzv/<run_id>/round/<r>``), the same prefix rdzv's own
  round store uses.
* ``rdzv`` with a shared secret or TLS (``auth_token_file``/
  ``$RDZV_AUTH_TOKEN``, ``ca_cert``), which torch's client cannot speak, or
  with ``store_type=file``, :class:`_AdapterStores`: rdzv's own round store,
  through :func:`rdzv.torch.as_torch_store`.
* ``rdzv-etcd`` / ``rdzv-redis``, :class:`_RankZeroStores`: group rank 0
  hosts a torch ``TCPStore`` for the round and publishes its address in
  rdzv's round store (:data:`AGENT_STORE_KEY`); the other ranks connect to
  it. It is dropped when the next round starts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from datetime import timedelta
from typing import TYPE_CHECKING

from rdzv import errors
from rdzv.api import RendezvousInfo
from rdzv.endpoint import format_endpoint, parse_endpoint
from rdzv.store.foreign import as_store
from rdzv.store.memory import PrefixStore
from rdzv.torch import as_torch_store

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store as TorchStore

__all__ = ["AGENT_STORE_KEY"]

AGENT_STORE_KEY = "torchrun/agent_store"
"""The round-store key under which group rank 0 publishes its torch store (etcd/Redis)."""


class _RoundStores(ABC):
    """Gives torch's agent a real torch store for each completed round."""

    @abstractmethod
    def round_store(self, info: RendezvousInfo) -> TorchStore:
        """Return torch's store for the round ``info`` describes."""

    def release(self) -> None:  # noqa: B027 - optional hook with a no-op default
        """Drop the stores of the last round."""

    def close(self) -> None:
        """Release every resource."""
        self.release()


class _SharedServerStores(_RoundStores):
    """A torch TCPStore client of the rdzv server, under each round's prefix."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self._host = host
        self._port = port
        self._timeout = timeout
        self._client: TorchStore | None = None

    def round_store(self, info: RendezvousInfo) -> TorchStore:
        # torch.distributed re-exports these without marking them public (mypy).
        from torch._C._distributed_c10d import PrefixStore as TorchPrefixStore  # noqa: PLC0415

        if not isinstance(info.store, PrefixStore):
            raise errors.RendezvousStateError(
                f"expected rdzv's round store to be a PrefixStore, got {type(info.store).__name__}"
            )
        if self._client is None:
            self._client = _torch_client(self._host, self._port, self._timeout)
        return TorchPrefixStore(info.store.prefix, self._client)

    def close(self) -> None:
        self._client = None


class _AdapterStores(_RoundStores):
    """rdzv's own round store (authenticated, TLS, a file), as a torch ``Store``."""

    def round_store(self, info: RendezvousInfo) -> TorchStore:
        return as_torch_store(as_store(info.store))


class _RankZeroStores(_RoundStores):
    """A torch TCPStore hosted by group rank 0 of each round."""

    def __init__(self, timeout: float) -> None:
        self._timeout = timeout
        self._current: TorchStore | None = None

    def round_store(self, info: RendezvousInfo) -> TorchStore:
        from torch._C._distributed_c10d import TCPStore  # noqa: PLC0415 - torch is optional

        if info.rank == 0:
            boot = info.bootstrap_store_info
            addr = boot.master_addr if boot is not None else "127.0.0.1"
            try:
                server = TCPStore(
                    addr,
                    0,
                    is_master=True,
                    wait_for_workers=False,
                    timeout=timedelta(seconds=self._timeout),
                )
            except (RuntimeError, OSError) as exc:
                raise errors.RendezvousConnectionError(
                    f"could not host the agents' torch store: {exc}"
                ) from exc
            info.store.set(AGENT_STORE_KEY, format_endpoint(addr, server.port))
            self._current = server
            return server
        raw = info.store.get(AGENT_STORE_KEY).decode("utf-8", "replace")
        host, port = parse_endpoint(raw)
        self._current = _torch_client(host, port, self._timeout)
        return self._current

    def release(self) -> None:
        self._current = None


def _torch_client(host: str, port: int, timeout: float) -> TorchStore:
    from torch._C._distributed_c10d import TCPStore  # noqa: PLC0415 - torch is optional

    try:
        return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
    except (RuntimeError, OSError) as exc:
        raise errors.RendezvousConnectionError(
            f"torch's TCPStore client could not connect to {format_endpoint(host, port)}: {exc}"
        ) from exc
