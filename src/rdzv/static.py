"""The static rendezvous: a fixed set of nodes with known ranks meet once per round.

Theory of operation. Node rank 0 hosts a TCP store (``is_master``); every
node connects to it. Round ``n`` uses the keys under ``rdzv.static/<run>/<n>``:
each node claims ``node/<rank>`` with ``compare_set`` (so two nodes started
with the same rank are caught), adds 1 to ``arrived`` and the node that
brings the count to ``world_size`` writes ``complete``. Everyone waits for
``complete`` up to the timeout; on timeout the ``node/<rank>`` keys tell
which ranks never arrived. A launcher that restarts calls
:meth:`StaticTCPRendezvous.next_rendezvous` again on every node, which starts
the next round with fresh keys.
"""

from __future__ import annotations

import uuid

from rdzv.api import RendezvousHandler, RendezvousInfo, RendezvousParameters, RendezvousStoreInfo
from rdzv.endpoint import DEFAULT_PORT, parse_endpoint
from rdzv.errors import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousStateError,
    RendezvousTimeoutError,
    StoreTimeoutError,
)
from rdzv.store.memory import PrefixStore
from rdzv.store.tcp import TCPStore

__all__ = ["StaticTCPRendezvous", "create_rdzv_handler"]

_KEY_ROOT = "rdzv.static"


class StaticTCPRendezvous(RendezvousHandler):
    """A one-group rendezvous over a TCP store hosted by node rank 0.

    Args:
        params_or_endpoint: :class:`RendezvousParameters` (endpoint, run id,
            ``node_rank``, ``max_nodes`` as world size, ``timeout`` or
            ``join_timeout`` in the config) or the store's endpoint
            ``host[:port]``.
        master_port: The store's port; overrides the endpoint's. Node rank 0
            may give 0 to host on a free port.
        rank: This node's rank, ``0..world_size-1``.
        world_size: The number of nodes.
        run_id: The run identifier (keys of different runs do not mix).
        timeout: Seconds to wait for every node to arrive.

    Raises:
        ValueError: A value is out of range or ``min_nodes != max_nodes``;
            the message names it.
    """

    def __init__(
        self,
        params_or_endpoint: RendezvousParameters | str,
        master_port: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        run_id: str = "",
        timeout: float = 600,
    ) -> None:
        if isinstance(params_or_endpoint, RendezvousParameters):
            params = params_or_endpoint
            if params.min_nodes != params.max_nodes:
                raise ValueError(
                    "the static rendezvous needs a fixed number of nodes, got "
                    f"min_nodes={params.min_nodes} max_nodes={params.max_nodes}"
                )
            endpoint = params.endpoint
            rank = params.get_as_int("rank", params.node_rank) or 0
            world_size = params.max_nodes
            run_id = params.run_id
            timeout = (
                params.get_as_seconds("timeout") or params.get_as_seconds("join_timeout") or timeout
            )
        else:
            endpoint = params_or_endpoint
        host, port = parse_endpoint(endpoint, DEFAULT_PORT)
        if master_port is not None:
            port = master_port
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank!r}")
        if not 0 <= port <= 65535 or (port == 0 and rank != 0):
            raise ValueError(
                f"port {port} is not valid for rank {rank} (only rank 0 may host on port 0)"
            )
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        self._host = host
        self._rank = rank
        self._world_size = world_size
        self._run_id = run_id
        self._timeout = float(timeout)
        self._token = uuid.uuid4().hex
        self._round = 0
        self._store = TCPStore(host, port, is_master=rank == 0, timeout=self._timeout)
        self._port = self._store.port
        self._closed_key = f"{_KEY_ROOT}/{run_id}/closed"

    @property
    def port(self) -> int:
        """The port of the store (the real one when rank 0 hosts on port 0)."""
        return self._port

    def get_backend(self) -> str:
        """Return ``"static"``."""
        return "static"

    @property
    def use_agent_store(self) -> bool:
        """True: the store is the one node rank 0 hosts."""
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        """Wait until every node has arrived for the next round.

        Returns:
            This node's rank, the world size, the round's store and rank 0's
            bootstrap address.

        Raises:
            RendezvousClosedError: The run was closed.
            RendezvousStateError: Another node claimed this node's rank.
            RendezvousTimeoutError: Not every node arrived in time; the
                message names the missing ranks.
        """
        if self.is_closed():
            raise RendezvousClosedError(f"the static rendezvous of run {self._run_id!r} is closed")
        round_store = PrefixStore(f"{_KEY_ROOT}/{self._run_id}/{self._round}", self._store)
        self._round += 1
        claimed = round_store.compare_set(f"node/{self._rank}", "", self._token)
        if claimed != self._token.encode():
            raise RendezvousStateError(
                f"rank {self._rank} of run {self._run_id!r} is already taken by another node; "
                "give every node a different --node-rank"
            )
        if round_store.add("arrived", 1) == self._world_size:
            round_store.set("complete", "1")
        try:
            round_store.wait(["complete"], timeout=self._timeout)
        except StoreTimeoutError:
            head = (
                f"the static rendezvous of run {self._run_id!r} timed out after {self._timeout:g} s"
            )
            try:
                missing = [
                    r for r in range(self._world_size) if not round_store.check([f"node/{r}"])
                ]
            except RendezvousConnectionError:
                raise RendezvousTimeoutError(
                    f"{head}, and the store of node rank 0 is gone, so who is missing is unknown"
                ) from None
            raise RendezvousTimeoutError(
                f"{head}: node rank(s) {missing} of {self._world_size} did not arrive"
            ) from None
        bootstrap = RendezvousStoreInfo.build(
            self._rank,
            PrefixStore("bootstrap", round_store),
            local_addr=self._host if self._rank == 0 else None,
            server_port=self._port if self._rank == 0 else None,
        )
        return RendezvousInfo(round_store, self._rank, self._world_size, bootstrap)

    def is_closed(self) -> bool:
        """Tell whether any node closed the run."""
        return self._store.check([self._closed_key])

    def set_closed(self) -> None:
        """Close the run: later rounds raise ``RendezvousClosedError``."""
        self._store.set(self._closed_key, "1")

    def num_nodes_waiting(self) -> int:
        """Return 0: a static group never admits more nodes."""
        return 0

    def get_run_id(self) -> str:
        """Return the run identifier."""
        return self._run_id

    def shutdown(self) -> bool:
        """Close the connection (and, on rank 0, the store server).

        Returns:
            True.
        """
        self._store.close()
        return True


def create_rdzv_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Build a :class:`StaticTCPRendezvous` from parameters (the ``static`` backend).

    Args:
        params: Endpoint, run id, ``node_rank`` and ``max_nodes``.

    Returns:
        The handler.
    """
    return StaticTCPRendezvous(params)
