"""The workers' bootstrap store: a fresh TCP store per attempt.

Group rank 0's agent starts a new store server for every attempt and
publishes its address in the round's store; the other agents read it. The
workers get it as ``MASTER_ADDR``/``MASTER_PORT``. Because the server is new
each time, no key of an earlier attempt can confuse the workers of a later
one, and a node that becomes rank 0 in a later round always publishes an
address (the old rank 0 may be gone).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from rdzv.api import RendezvousStoreInfo
from rdzv.keys import LAUNCH_ROOT
from rdzv.launch.ranks import wait_for_keys
from rdzv.store.base import Store
from rdzv.store.memory import PrefixStore
from rdzv.store.tcp import TCPStore

__all__ = ["BootstrapFactory", "BootstrapServer", "exchange_bootstrap", "tcp_store_server"]


class BootstrapServer(Protocol):
    """A running store server the workers connect to."""

    @property
    def port(self) -> int:
        """The port the server listens on."""

    def close(self) -> None:
        """Stop the server."""


BootstrapFactory = Callable[[], BootstrapServer]


def tcp_store_server(listen: Sequence[str] | None = None) -> BootstrapServer:
    """Start an rdzv TCP store server on a free port, listening on ``listen`` (None: every address).

    The agent itself connects to it over loopback (see :func:`~rdzv.net.listen_addresses`).
    """
    return TCPStore("127.0.0.1", 0, is_master=True, listen=listen)


def exchange_bootstrap(
    round_store: Store,
    group_rank: int,
    factory: BootstrapFactory,
    local_addr: str | None,
    wait: Callable[[Store, Sequence[str]], None] = wait_for_keys,
) -> tuple[RendezvousStoreInfo, BootstrapServer | None]:
    """Start (group rank 0) or find (other ranks) this attempt's bootstrap store.

    Args:
        round_store: The round's store.
        group_rank: This node's rank in the round.
        factory: Starts a store server (called on group rank 0 only).
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
    server = factory()
    try:
        info = RendezvousStoreInfo.build(0, store, local_addr=local_addr, server_port=server.port)
    except BaseException:
        server.close()
        raise
    return info, server
