"""rdzv as a torchrun rendezvous backend (``--rdzv-backend=rdzv``, ``rdzv-etcd``, ``rdzv-redis``).

Theory of operation
-------------------
torch (2.13) loads the entry points of the group ``torchrun.handlers``,
calls each with no arguments and registers what it returns as a creator
``(torch RendezvousParameters) -> torch RendezvousHandler``. The creators
here translate torch's parameters into rdzv's, build an rdzv
:class:`~rdzv.dynamic.handler.DynamicRendezvousHandler`, and wrap it in a
subclass of torch's ``RendezvousHandler`` (defined lazily: this is the only
rdzv module that imports torch, and only when a creator is called).

torch's agent needs a real ``torch.distributed.Store`` from every round (it
assigns worker ranks and runs its exit barrier through it):

* ``rdzv`` (TCP store): a stock ``torch.distributed.TCPStore`` client
  connected to the rdzv server, under the round's prefix
  (``rdzv/<run_id>/round/<r>``), the same prefix rdzv's own round store
  uses. torch's client keeps the GIL during some calls, so it must not talk
  to a server in its own process: the node that hosts the endpoint runs the
  rdzv server in a child process (``python -m rdzv.torchrun serve PORT``).
  The child exits when its stdin closes (the agent shut down or died) and
  its last client disconnected, or a few seconds later at most.
  With a shared secret or TLS (``auth_token_file``/``$RDZV_AUTH_TOKEN``,
  ``ca_cert``, ``ssl_cert``/``ssl_cert_key``), which torch's client cannot
  speak, the server child gets them too and torch's agent gets rdzv's own
  round store instead, through a ``torch.distributed.Store`` subclass
  written in Python (torch's agent calls it from Python only).
* ``rdzv-etcd`` / ``rdzv-redis``: group rank 0 hosts a torch ``TCPStore``
  for the round and publishes its address in rdzv's round store; the other
  ranks connect to it. It is dropped when the next round starts.

The handler, its errors, a spare's exit and ``shutdown()``:
:mod:`rdzv.torchrun.handler`.
"""

from __future__ import annotations

import functools
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

from rdzv import errors
from rdzv.api import RendezvousInfo, RendezvousParameters
from rdzv.auth import resolve_auth_token
from rdzv.backends.base import text_option
from rdzv.backends.store import DEFAULT_READ_TIMEOUT, StoreTLS, create_backend, endpoint_is_local
from rdzv.dynamic.handler import create_handler
from rdzv.endpoint import format_endpoint, parse_endpoint
from rdzv.registry import rendezvous_handler_registry
from rdzv.store.base import Store, Value
from rdzv.store.memory import PrefixStore
from rdzv.torchrun.handler import _dist_errors, _Resources, _torch_errors, _wrap
from rdzv.torchrun.server_child import _ServerProcess, _ServerStartError

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store as TorchStore
    from torch.distributed.elastic.rendezvous import api as torch_api

__all__ = [
    "AGENT_STORE_KEY",
    "create_rdzv_etcd_handler",
    "create_rdzv_handler",
    "create_rdzv_redis_handler",
    "etcd_creator",
    "redis_creator",
    "tcp_creator",
    "to_rdzv_parameters",
]

LOGGER = logging.getLogger("rdzv.torchrun")

AGENT_STORE_KEY = "torchrun/agent_store"
"""The round-store key under which group rank 0 publishes its torch store (etcd/Redis)."""

TorchCreator = Callable[["torch_api.RendezvousParameters"], "torch_api.RendezvousHandler"]


# -- parameters ----------------------------------------------------------------


def to_rdzv_parameters(
    params: torch_api.RendezvousParameters, backend: str
) -> RendezvousParameters:
    """Translate torch's rendezvous parameters into rdzv's.

    Every ``--rdzv-conf`` key is kept (as the string torchrun passes) and read
    by rdzv's usual getters; ``rank`` (what torchrun sets from
    ``--node-rank``) becomes ``node_rank``. torch's legacy ``timeout`` key
    (torchrun always sets it, 900 s) is dropped, as torch's ``c10d`` backend
    ignores it too: use ``join_timeout``.

    Args:
        params: torch's parameters.
        backend: The rdzv backend name (``c10d``, ``etcd``, ``redis``).

    Returns:
        rdzv's parameters.

    Raises:
        ValueError: A value is invalid; the message names it.
    """
    config = dict(params.config)
    config.pop("timeout", None)
    rank = config.pop("rank", None)
    try:
        node_rank = 0 if rank is None else int(rank)
    except (TypeError, ValueError):
        raise ValueError(f"the node rank must be an integer, got {rank!r}") from None
    return RendezvousParameters(
        backend,
        params.endpoint,
        params.run_id,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        node_rank=node_rank,
        config=config,
    )


# -- per-round torch stores ------------------------------------------------------


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
    """rdzv's own round store (authenticated, TLS), as a torch ``Store``."""

    def round_store(self, info: RendezvousInfo) -> TorchStore:
        return _store_adapter_class()(info.store)


@functools.cache
def _store_adapter_class() -> Callable[[Store], TorchStore]:
    """Define the torch ``Store`` adapter class (imports torch, so only on first use)."""
    from torch._C._distributed_c10d import Store as TorchStoreBase  # noqa: PLC0415

    class RdzvStoreAdapter(TorchStoreBase):
        """A ``torch.distributed.Store`` over an rdzv :class:`~rdzv.store.base.Store`.

        The calls torch's agent makes (``set``, ``get``, ``add``, ``check``,
        ``wait``, ``multi_get``, ``multi_set``, ...) go to the rdzv store;
        ``get`` and ``wait`` without a timeout use this store's timeout
        (``set_timeout``), as torch's stores do. rdzv's timeouts become
        torch's ``DistStoreError`` and its connection errors
        ``DistNetworkError``.

        Args:
            inner: The rdzv store.
        """

        def __init__(self, inner: Store) -> None:
            super().__init__()
            self._inner = inner
            self._timeout = inner.timeout
            self.set_timeout(inner.timeout)

        def set_timeout(self, timeout: timedelta) -> None:
            super().set_timeout(timeout)
            self._timeout = timeout

        def set(self, key: str, value: Value) -> None:
            with _dist_errors():
                self._inner.set(key, value)

        def get(self, key: str) -> bytes:
            with _dist_errors():
                self._inner.wait([key], self._timeout)
                return self._inner.get(key)

        def add(self, key: str, value: int) -> int:
            with _dist_errors():
                return self._inner.add(key, value)

        def compare_set(self, key: str, expected_value: Value, desired_value: Value) -> bytes:
            with _dist_errors():
                return self._inner.compare_set(key, expected_value, desired_value)

        def check(self, keys: list[str]) -> bool:
            with _dist_errors():
                return self._inner.check(keys)

        def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
            with _dist_errors():
                self._inner.wait(keys, self._timeout if timeout is None else timeout)

        def delete_key(self, key: str) -> bool:
            with _dist_errors():
                return self._inner.delete_key(key)

        def num_keys(self) -> int:
            with _dist_errors():
                return self._inner.num_keys()

        def append(self, key: str, value: Value) -> None:
            with _dist_errors():
                self._inner.append(key, value)

        def multi_get(self, keys: list[str]) -> list[bytes]:
            with _dist_errors():
                self._inner.wait(keys, self._timeout)
                return self._inner.multi_get(keys)

        def multi_set(self, keys: list[str], values: list[Value]) -> None:
            with _dist_errors():
                self._inner.multi_set(keys, values)

    return RdzvStoreAdapter


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


def _spare_exit(params: RendezvousParameters) -> str:
    value = str(params.get("spare_exit", "exit0")).strip().lower()
    if value not in ("exit0", "raise"):
        raise ValueError(f"spare_exit must be 'exit0' or 'raise', got {params.get('spare_exit')!r}")
    return value


# -- creators ------------------------------------------------------------------------


def create_rdzv_handler(params: torch_api.RendezvousParameters) -> torch_api.RendezvousHandler:
    """Build the ``rdzv`` torchrun backend: dynamic rendezvous over rdzv's TCP store.

    The node whose address matches the endpoint host (or that sets
    ``is_host=1``) runs the store server in a child process; if the port is
    taken (another local agent hosts it), it connects as a client.

    ``--rdzv-conf`` keys: those of rdzv's dynamic rendezvous (``join_timeout``,
    ``last_call_timeout``, ``close_timeout``, ``heartbeat``,
    ``keep_alive_interval``, ``keep_alive_max_attempt``), of its store
    backend (``read_timeout``, ``is_host``, ``auth_token_file``,
    ``ca_cert``/``cacert``, ``ssl_cert``, ``ssl_cert_key``; the secret may
    also come from ``$RDZV_AUTH_TOKEN``), and ``spare_exit`` (``exit0``, the
    default, or ``raise``: see :mod:`rdzv.torchrun.handler`).

    Args:
        params: torch's parameters (``--rdzv-endpoint``, ``--nnodes``,
            ``--rdzv-id``, ``--rdzv-conf`` ...).

    Returns:
        A torch ``RendezvousHandler``.

    Raises:
        ValueError: A parameter is invalid (including half-given TLS settings).
        OSError: ``auth_token_file`` cannot be read.
        torch.distributed.elastic.rendezvous.RendezvousConnectionError: The
            store could not be hosted or reached, or refused the secret or
            certificate.
    """
    rdzv_params = to_rdzv_parameters(params, "c10d")
    spare_exit = _spare_exit(rdzv_params)
    host, port = parse_endpoint(rdzv_params.endpoint)
    timeout = rdzv_params.get_as_seconds("read_timeout") or DEFAULT_READ_TIMEOUT
    token_file = text_option(rdzv_params, "auth_token_file")
    tls = StoreTLS(rdzv_params)
    secured = tls.ca is not None or resolve_auth_token(token_file) is not None
    explicit = rdzv_params.get_as_bool("is_host")
    if explicit and not tls.can_host:
        raise ValueError(
            f"{tls.ca[0] if tls.ca else 'ca_cert'} is set (TLS on) but this node hosts the "
            "store (is_host=1) and has no ssl_cert/ssl_cert_key to serve it with"
        )
    server: _ServerProcess | None = None
    if explicit or (explicit is None and tls.can_host and endpoint_is_local(host)):
        tls.server_context()  # a certificate that cannot be loaded is a ValueError naming it
        try:
            server = _ServerProcess.start(port, token_file, tls.server_files)
        except _ServerStartError as exc:
            if explicit:
                with _torch_errors():
                    raise errors.RendezvousConnectionError(
                        f"could not host the rdzv store on port {port} (is_host=1): {exc}"
                    ) from exc
            LOGGER.info("rdzv store server not started on port %d (a client then): %s", port, exc)
    rdzv_params.config["is_host"] = False
    stores: _RoundStores = _AdapterStores() if secured else _SharedServerStores(host, port, timeout)
    resources = _Resources(stores, server=server)
    try:
        with _torch_errors():
            backend, store = create_backend(rdzv_params)
        resources.closers = (backend.close, store.close)
        inner = create_handler(store, backend, rdzv_params)
    except BaseException:
        resources.close()
        raise
    return _wrap(params.backend, inner, resources, spare_exit)


def _create_from_registry(
    params: torch_api.RendezvousParameters, backend: str
) -> torch_api.RendezvousHandler:
    known = rendezvous_handler_registry.backends()
    if backend not in known:
        raise ValueError(
            f"the torchrun backend {params.backend!r} needs rdzv's {backend!r} rendezvous "
            f"backend, which this installation of rdzv does not provide (known rdzv backends: "
            f"{', '.join(known)})"
        )
    rdzv_params = to_rdzv_parameters(params, backend)
    spare_exit = _spare_exit(rdzv_params)
    timeout = rdzv_params.get_as_seconds("read_timeout") or DEFAULT_READ_TIMEOUT
    with _torch_errors():
        inner = rendezvous_handler_registry.create_handler(rdzv_params)
    return _wrap(params.backend, inner, _Resources(_RankZeroStores(timeout)), spare_exit)


def create_rdzv_etcd_handler(
    params: torch_api.RendezvousParameters,
) -> torch_api.RendezvousHandler:
    """Build the ``rdzv-etcd`` torchrun backend: rdzv's dynamic rendezvous on etcd v3.

    Args:
        params: torch's parameters; the endpoint is the etcd cluster.

    Returns:
        A torch ``RendezvousHandler``.

    Raises:
        ValueError: rdzv's ``etcd`` backend is not available, or a parameter
            is invalid.
    """
    return _create_from_registry(params, "etcd")


def create_rdzv_redis_handler(
    params: torch_api.RendezvousParameters,
) -> torch_api.RendezvousHandler:
    """Build the ``rdzv-redis`` torchrun backend: rdzv's dynamic rendezvous on Redis.

    Args:
        params: torch's parameters; the endpoint is the Redis server.

    Returns:
        A torch ``RendezvousHandler``.

    Raises:
        ValueError: rdzv's ``redis`` backend is not available, or a parameter
            is invalid.
    """
    return _create_from_registry(params, "redis")


def tcp_creator() -> TorchCreator:
    """Entry point ``torchrun.handlers: rdzv``: return the creator torch registers."""
    return create_rdzv_handler


def etcd_creator() -> TorchCreator:
    """Entry point ``torchrun.handlers: rdzv-etcd``: return the creator torch registers."""
    return create_rdzv_etcd_handler


def redis_creator() -> TorchCreator:
    """Entry point ``torchrun.handlers: rdzv-redis``: return the creator torch registers."""
    return create_rdzv_redis_handler
