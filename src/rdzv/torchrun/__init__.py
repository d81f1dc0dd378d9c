"""rdzv as a torchrun rendezvous backend (``--rdzv-backend=rdzv``, ``rdzv-etcd``, ``rdzv-redis``).

Theory of operation
-------------------
torch (2.13) loads the entry points of the group ``torchrun.handlers``,
calls each with no arguments and registers what it returns as a creator
``(torch RendezvousParameters) -> torch RendezvousHandler``. The creators
here translate torch's parameters into rdzv's, build an rdzv
:class:`~rdzv.dynamic.handler.DynamicRendezvousHandler`, and wrap it in a
subclass of torch's ``RendezvousHandler`` (defined lazily: this is the only
rdzv package that imports torch, and only when a creator is called).

Each module opens with its part of the story:

* :mod:`rdzv.torchrun.handler`: the torch handler (``use_agent_store``,
  rdzv's errors as torch's, a spare's graceful exit, ``shutdown()``,
  re-joining a round).
* :mod:`rdzv.torchrun.stores`: the real ``torch.distributed.Store`` that
  torch's agent gets from every round, for each backend.
* :mod:`rdzv.torchrun.server_child`: the ``rdzv`` backend's store server,
  which the hosting node runs in a child process
  (``python -m rdzv.torchrun serve PORT``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rdzv import errors
from rdzv.api import RendezvousParameters, RendezvousSettings, given_node_rank
from rdzv.backends.options import StoreBackendOptions
from rdzv.backends.store import open_store
from rdzv.dynamic.admission_options import admission_from_params
from rdzv.dynamic.events import recorded_creation
from rdzv.dynamic.handler import DynamicRendezvousHandler
from rdzv.net import advertised_address, listen_addresses
from rdzv.registry import rendezvous_handler_registry
from rdzv.torchrun.events import bridged_creation
from rdzv.torchrun.handler import _Resources, _torch_errors, _wrap
from rdzv.torchrun.server_child import _ServerProcess, _ServerStartError
from rdzv.torchrun.stores import (
    AGENT_STORE_KEY,
    _AdapterStores,
    _RankZeroStores,
    _RoundStores,
    _SharedServerStores,
)

if TYPE_CHECKING:
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

    Raises:
        ValueError: A value is invalid; the message names it.
    """
    config = dict(params.config)
    config.pop("timeout", None)
    rank = config.pop("rank", None)
    try:
        rank_kwargs: dict[str, Any] = {} if rank is None else {"node_rank": int(rank)}
    except (TypeError, ValueError):
        raise ValueError(f"the node rank must be an integer, got {rank!r}") from None
    return RendezvousParameters(
        backend,
        params.endpoint,
        params.run_id,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        config=config,
        **rank_kwargs,
    )


def _spare_exit(params: RendezvousParameters) -> str:
    value = str(params.get("spare_exit", "exit0")).strip().lower()
    if value not in ("exit0", "raise"):
        raise ValueError(f"spare_exit must be 'exit0' or 'raise', got {params.get('spare_exit')!r}")
    return value


# -- creators ------------------------------------------------------------------------


def _start_server_if_this_node_hosts(options: StoreBackendOptions) -> _ServerProcess | None:
    """Start the ``rdzv`` store's server child when this node hosts the store (else None).

    Whether it hosts is :meth:`StoreBackendOptions.should_host
    <rdzv.backends.options.StoreBackendOptions.should_host>`, the decision
    rdzv's own c10d backend makes; only the mechanism differs (a child
    process, since torch's client must not talk to a server in its own
    process). A host by inference whose server cannot start (another local
    agent hosts the port) is a client instead.

    Args:
        options: The store backend's options.

    Raises:
        ValueError: A server certificate that cannot be loaded.
        torch.distributed.elastic.rendezvous.RendezvousConnectionError:
            ``is_host=1`` and the server child could not serve.
    """
    if not options.should_host():
        return None
    options.tls.server_context()  # a certificate that cannot be loaded is a ValueError naming it
    try:
        return _ServerProcess.start(
            options.port,
            options.auth_token_file,
            options.tls.server_files,
            listen_addresses(options.host, listen_all=options.listen_all),
        )
    except _ServerStartError as exc:
        if options.is_host:
            with _torch_errors():
                raise errors.RendezvousConnectionError(
                    f"could not host the rdzv store on port {options.port} (is_host=1): {exc}"
                ) from exc
        LOGGER.info(
            "rdzv store server not started on port %d (a client then): %s", options.port, exc
        )
        return None


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

    Raises:
        ValueError: A parameter is invalid (including half-given TLS settings).
        torch.distributed.elastic.rendezvous.RendezvousConnectionError: The
            store could not be hosted or reached, or refused the secret or
            certificate.

    A failure is recorded as torch's ``create_handler`` records one
    (:func:`~rdzv.dynamic.events.recorded_creation`,
    :func:`~rdzv.torchrun.events.bridged_creation`).
    """
    with bridged_creation(params.run_id), recorded_creation(params.run_id):
        return _create_rdzv_handler(params)


def _create_rdzv_handler(params: torch_api.RendezvousParameters) -> torch_api.RendezvousHandler:
    rdzv_params = to_rdzv_parameters(params, "c10d")
    spare_exit = _spare_exit(rdzv_params)
    options = StoreBackendOptions.from_params(rdzv_params)
    settings = RendezvousSettings.from_params(rdzv_params)
    admission = admission_from_params(rdzv_params, os.environ)
    server = _start_server_if_this_node_hosts(options)
    stores: _RoundStores = (
        _SharedServerStores(options.host, options.port, options.read_timeout)
        if options.store_type == "tcp" and not options.secured
        else _AdapterStores()
    )
    resources = _Resources(stores, server=server)
    try:
        with _torch_errors():
            backend, store = open_store(dataclasses.replace(options, is_host=False))
        resources.closers = (backend.close, store.close)
        inner = DynamicRendezvousHandler.from_settings(
            settings,
            store,
            backend,
            rdzv_params.local_addr or advertised_address(rdzv_params.endpoint),
            node_rank=given_node_rank(rdzv_params),
            admission=admission,
        )
    except BaseException:
        resources.close()
        raise
    resources.closers = (inner.close,)
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
    # The backend's create_handler records a failure; torch hears of it.
    with bridged_creation(params.run_id), _torch_errors():
        inner = rendezvous_handler_registry.create_handler(rdzv_params)
    if not isinstance(inner, DynamicRendezvousHandler):
        raise ValueError(  # noqa: TRY004 - a backend the user named, not an argument type
            f"rdzv's {backend!r} backend built a {type(inner).__name__}, not a dynamic handler"
        )
    timeout = inner.store.timeout.total_seconds()
    resources = _Resources(_RankZeroStores(timeout), closers=(inner.close,))
    return _wrap(params.backend, inner, resources, spare_exit)


def create_rdzv_etcd_handler(params: torch_api.RendezvousParameters) -> torch_api.RendezvousHandler:
    """Build the ``rdzv-etcd`` torchrun backend: rdzv's dynamic rendezvous on etcd v3.

    Raises:
        ValueError: rdzv's ``etcd`` backend is not available, or a parameter
            is invalid.
    """
    return _create_from_registry(params, "etcd")


def create_rdzv_redis_handler(
    params: torch_api.RendezvousParameters,
) -> torch_api.RendezvousHandler:
    """Build the ``rdzv-redis`` torchrun backend: rdzv's dynamic rendezvous on Redis.

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
