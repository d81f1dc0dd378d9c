"""The workers' bootstrap store: a fresh TCP store per attempt, sized for the round.

Group rank 0's agent starts a new store server for every attempt and
publishes its address in the round's store; the other agents read it. The
workers get it as ``MASTER_ADDR``/``MASTER_PORT``. Because the server is new
each time, no key of an earlier attempt can confuse the workers of a later
one, and a node that becomes rank 0 in a later round always publishes an
address (the old rank 0 may be gone).

Theory of operation. The factory is told what the round needs
(:class:`BootstrapSpec`: the workers of the round, the agents of the round,
the address to listen on) and picks the server once per attempt
(:func:`bootstrap_server`):

* from :data:`TORCH_SERVER_MIN_WORLD` workers on, when torch is importable
  (the workers run torch anyway), torch's own libuv ``TCPStore`` server
  (:mod:`rdzv.launch.torch_server`): its loop runs in C++ without the
  interpreter lock, so a storm of workers' connections neither waits on the
  agent's threads nor starves them (the agent's keep-alive beats on);
* otherwise rdzv's server (:func:`rdzv_store_server`), its connection limit
  derived from the round (:func:`connection_limit`): a job of more workers
  than the server's default limit is admitted whole, and anything past the
  round's need is still refused.

Either way the process's soft open-file limit is raised, up to the hard
limit, to what the round's connections need (:func:`raise_open_files`):
each worker holds one socket on the server.
"""

from __future__ import annotations

import importlib.util
import resource
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from rdzv.api import RendezvousStoreInfo
from rdzv.keys import LAUNCH_ROOT
from rdzv.launch.ranks import wait_for_keys
from rdzv.store.base import Store
from rdzv.store.memory import PrefixStore
from rdzv.store.tcp import TCPStore

__all__ = [
    "CONNECTIONS_PER_WORKER",
    "TORCH_SERVER_MIN_WORLD",
    "BootstrapFactory",
    "BootstrapServer",
    "BootstrapSpec",
    "bootstrap_server",
    "connection_limit",
    "exchange_bootstrap",
    "raise_open_files",
    "rdzv_store_server",
    "torch_available",
]

# Room per worker: its ``init_process_group`` client, and one more for a
# clone or a reconnection that overlaps the old connection's close.
CONNECTIONS_PER_WORKER: Final = 2
# Connections beyond the round's: the hosting agent's own client, tools.
_SPARE_CONNECTIONS: Final = 64
# From this many workers on, torch's libuv server serves them when torch is
# importable; smaller jobs keep rdzv's server, which starts without
# importing torch into the agent.
TORCH_SERVER_MIN_WORLD: Final = 1024


class BootstrapServer(Protocol):
    """A running store server the workers connect to."""

    @property
    def port(self) -> int:
        """The port the server listens on."""

    def close(self) -> None:
        """Stop the server."""


@dataclass(frozen=True)
class BootstrapSpec:
    """What the bootstrap store of one attempt serves.

    Args:
        world_size: The workers of the round (``WORLD_SIZE``).
        nodes: The agents of the round.
        listen: The addresses to listen on (the published one first); every
            address when None.
    """

    world_size: int
    nodes: int = 1
    listen: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {self.world_size}")
        if self.nodes < 1:
            raise ValueError(f"nodes must be at least 1, got {self.nodes}")


BootstrapFactory = Callable[[BootstrapSpec], BootstrapServer]


def connection_limit(spec: BootstrapSpec) -> int:
    """Return the connections the bootstrap store of ``spec`` admits.

    Room for every worker's client and a reconnection each, one connection
    per agent of the round, and a few spare; never less than the store
    server's default.
    """
    from rdzv.store.server import DEFAULT_MAX_CONNECTIONS  # noqa: PLC0415 - hosts only

    wanted = CONNECTIONS_PER_WORKER * spec.world_size + spec.nodes + _SPARE_CONNECTIONS
    return max(DEFAULT_MAX_CONNECTIONS, wanted)


def raise_open_files(sockets: int) -> int:
    """Raise this process's soft open-file limit to leave room for ``sockets`` more.

    Never lowers it, and never past the hard limit. Returns the soft limit
    now in force.
    """
    from rdzv.store.admission import FD_HEADROOM, open_descriptors  # noqa: PLC0415 - hosts only

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return soft
    wanted = open_descriptors() + sockets + FD_HEADROOM
    if wanted <= soft:
        return soft
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return target


def rdzv_store_server(spec: BootstrapSpec) -> BootstrapServer:
    """Start an rdzv TCP store server on a free port, admitting the round of ``spec``.

    It listens on ``spec.listen``; the agent itself connects to it over loopback.
    """
    from rdzv.store.server import DEFAULT_MAX_HANDSHAKES  # noqa: PLC0415 - hosts only

    limit = connection_limit(spec)
    raise_open_files(limit + DEFAULT_MAX_HANDSHAKES)
    listen = None if spec.listen is None else list(spec.listen)
    return TCPStore("127.0.0.1", 0, is_master=True, max_connections=limit, listen=listen)


def torch_available() -> bool:
    """Tell whether torch can be imported here."""
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):  # a broken or blocked installation
        return False


def bootstrap_server(spec: BootstrapSpec) -> BootstrapServer:
    """Start the bootstrap store of one attempt: the agent's default factory.

    torch's libuv server from :data:`TORCH_SERVER_MIN_WORLD` workers on when
    torch is importable, rdzv's server otherwise.
    """
    if spec.world_size >= TORCH_SERVER_MIN_WORLD and torch_available():
        from rdzv.launch.torch_server import torch_store_server  # noqa: PLC0415 - imports torch

        limit = connection_limit(spec)
        raise_open_files(limit)
        # torch's server takes one listening socket: the published address's.
        host = None if spec.listen is None else spec.listen[0]
        return torch_store_server(host, backlog=limit)
    return rdzv_store_server(spec)


def exchange_bootstrap(
    round_store: Store,
    group_rank: int,
    factory: BootstrapFactory,
    spec: BootstrapSpec,
    local_addr: str | None,
    wait: Callable[[Store, Sequence[str]], None] = wait_for_keys,
) -> tuple[RendezvousStoreInfo, BootstrapServer | None]:
    """Start (group rank 0) or find (other ranks) this attempt's bootstrap store.

    Args:
        round_store: The round's store.
        group_rank: This node's rank in the round.
        factory: Starts a store server (called on group rank 0 only).
        spec: What the store serves (the factory's argument).
        local_addr: The address rank 0 publishes; found with ``getaddrinfo`` when None.
        wait: Waits (on other ranks) until rank 0 published the address.

    Returns:
        The store's address and, on group rank 0, the server to close when
        the attempt ends.
    """
    store = PrefixStore(f"{LAUNCH_ROOT}/bootstrap", round_store)
    if group_rank != 0:
        wait(store, ["MASTER_ADDR", "MASTER_PORT"])
        return RendezvousStoreInfo.build(group_rank, store), None
    server = factory(spec)
    try:
        info = RendezvousStoreInfo.build(0, store, local_addr=local_addr, server_port=server.port)
    except BaseException:
        server.close()
        raise
    return info, server
