"""The static rendezvous: a fixed set of nodes with known ranks meet once per round.

Theory of operation. The constructor only validates; every connection is made
by :meth:`StaticTCPRendezvous.next_rendezvous`, as torch's does. The first
call hosts the TCP store on node rank 0 (``is_master``) or connects to it on
the other nodes; a failure to host (port in use, privileged port) or to
connect is a :class:`~rdzv.errors.RendezvousConnectionError` naming the
address. Round ``n`` uses the keys under ``rdzv.static/<run>/<n>``: each node
claims ``node/<rank>`` with ``compare_set`` (so two nodes started with the
same rank are caught), adds 1 to ``arrived`` and the node that brings the
count to ``world_size`` writes ``complete``. Everyone waits for ``complete``
up to the timeout; on timeout the ``node/<rank>`` keys tell which ranks never
arrived. A launcher that restarts calls
:meth:`StaticTCPRendezvous.next_rendezvous` again on every node, which starts
the next round with fresh keys.
"""

from __future__ import annotations

import errno
import uuid

from rdzv.api import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    given_node_rank,
)
from rdzv.endpoint import DEFAULT_PORT, format_endpoint, parse_endpoint
from rdzv.errors import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousStateError,
    RendezvousTimeoutError,
    StoreTimeoutError,
)
from rdzv.keys import static_prefix
from rdzv.net import listen_addresses
from rdzv.store.memory import PrefixStore
from rdzv.store.tcp import TCPStore

__all__ = ["StaticTCPRendezvous", "create_handler", "create_rdzv_handler"]

# torch 2.13's messages (static_tcp_rendezvous.create_rdzv_handler), verbatim.
_RANK_ABSENT = "rank is absent in RendezvousParameters.Try add --node-rank to the cmd request"
_ENDPOINT_ABSENT = (
    "endpoint is absent in RendezvousParametersTry add --master-port and --master-addr to the "
    "cmd request"
)


def _from_params(params: RendezvousParameters) -> tuple[str, int, int | None, int, str, float]:
    """Read ``(host, port, rank, world_size, run_id, timeout)`` as torch's creator does."""
    rank = params.get_as_int("rank", given_node_rank(params))
    if rank is None and params.max_nodes > 1:
        raise ValueError(
            f"{_RANK_ABSENT} (a group of {params.max_nodes} nodes needs each node's rank: "
            "the rank config key or RendezvousParameters(node_rank=...))"
        )
    endpoint = params.endpoint.strip()
    if not endpoint:
        raise ValueError(f"{_ENDPOINT_ABSENT} (the endpoint is node rank 0's host:port)")
    host, port = parse_endpoint(endpoint, default_port=-1)
    if port == -1:
        raise ValueError(
            f"Port is absent in endpoint: {endpoint}. Try launching with --master-port "
            "(the static rendezvous has no default port)"
        )
    if params.min_nodes != params.max_nodes:
        raise ValueError(
            "the static rendezvous needs a fixed number of nodes, got "
            f"min_nodes={params.min_nodes} max_nodes={params.max_nodes}"
        )
    timeout = params.get_as_seconds("timeout")
    if timeout is None:
        timeout = params.get_as_seconds("join_timeout")
    return host, port, rank, params.max_nodes, params.run_id, 600 if timeout is None else timeout


class StaticTCPRendezvous(RendezvousHandler):
    """A one-group rendezvous over a TCP store hosted by node rank 0.

    The arguments are torch's, in torch's order (``master_addr, master_port,
    rank, world_size, run_id, timeout``); :class:`RendezvousParameters` may
    stand in for all of them. Nothing is opened here: the store is hosted or
    reached by the first :meth:`next_rendezvous`.

    Args:
        params_or_endpoint: :class:`RendezvousParameters` (endpoint
            ``host:port``, run id, the ``rank`` config key or ``node_rank``,
            ``max_nodes`` as world size, ``timeout`` or ``join_timeout`` in
            the config) or the store's host (``host[:port]``).
        master_port: The store's port; overrides the endpoint's. Node rank 0
            may give 0 to host on a free port (known from :attr:`port` once
            hosted).
        rank: This node's rank, ``0..world_size-1``; required when
            ``world_size`` is more than 1, 0 otherwise.
        world_size: The number of nodes.
        run_id: The run identifier (keys of different runs do not mix).
        timeout: Seconds to wait for every node to arrive.

    Raises:
        ValueError: A value is out of range, ``rank`` is missing for a group
            of several nodes, the endpoint or its port is missing, or
            ``min_nodes != max_nodes``; torch's message first where torch
            checks the same.
    """

    def __init__(
        self,
        params_or_endpoint: RendezvousParameters | str,
        master_port: int | None = None,
        rank: int | None = None,
        world_size: int = 1,
        run_id: str = "",
        timeout: float = 600,
    ) -> None:
        if isinstance(params_or_endpoint, RendezvousParameters):
            host, port, rank, world_size, run_id, timeout = _from_params(params_or_endpoint)
        else:
            host, port = parse_endpoint(params_or_endpoint, DEFAULT_PORT)
        if master_port is not None:
            port = master_port
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        if rank is None:
            if world_size > 1:
                raise ValueError(f"{_RANK_ABSENT} (give rank= for a group of {world_size} nodes)")
            rank = 0
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank!r}")
        if not 0 <= port <= 65535 or (port == 0 and rank != 0):
            raise ValueError(
                f"port {port} is not valid for rank {rank} (only rank 0 may host on port 0)"
            )
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        self._host = host
        self._port = port
        self._rank = rank
        self._world_size = world_size
        self._run_id = run_id
        self._timeout = float(timeout)
        self._token = uuid.uuid4().hex
        self._round = 0
        self._store: TCPStore | None = None
        self._closed_here = False
        self._closed_key = f"{static_prefix(run_id)}closed"

    def _open_store(self) -> TCPStore:
        """Host (rank 0) or reach the store; a failure names the address."""
        if self._store is not None:
            return self._store
        address = format_endpoint(self._host, self._port)
        try:
            hosting = self._rank == 0
            self._store = TCPStore(
                self._host,
                self._port,
                is_master=hosting,
                timeout=self._timeout,
                listen=listen_addresses(self._host) if hosting else None,
            )
        except PermissionError as exc:
            raise RendezvousConnectionError(
                f"node rank 0 could not host the static rendezvous store on {address}: port "
                f"{self._port} is privileged (below 1024) and this process may not bind it; "
                f"pick a port of 1024 or more: {exc}"
            ) from exc
        except OSError as exc:
            reason = (
                f"port {self._port} is in use (another process listens on it)"
                if exc.errno == errno.EADDRINUSE
                else str(exc)
            )
            raise RendezvousConnectionError(
                f"node rank 0 could not host the static rendezvous store on {address}: {reason}"
            ) from exc
        except RendezvousConnectionError as exc:
            raise RendezvousConnectionError(
                f"node rank {self._rank} could not reach the static rendezvous store of node "
                f"rank 0 at {address}: {exc}"
            ) from exc
        self._port = self._store.port
        return self._store

    @property
    def port(self) -> int:
        """The store's port: as given until the first round, then the real one (port 0)."""
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
            RendezvousConnectionError: Node rank 0 could not host the store
                (port in use, privileged port), or another node could not
                reach it; the message names the address.
            RendezvousStateError: Another node claimed this node's rank.
            RendezvousTimeoutError: Not every node arrived in time; the
                message names the missing ranks.
        """
        store = self._open_store()
        if self.is_closed():
            raise RendezvousClosedError(f"the static rendezvous of run {self._run_id!r} is closed")
        round_store = PrefixStore(f"{static_prefix(self._run_id)}{self._round}", store)
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
        """Tell whether any node closed the run.

        Before the first :meth:`next_rendezvous` nothing is connected, so
        only a :meth:`set_closed` on this handler counts.
        """
        if self._closed_here:
            return True
        return self._store is not None and self._store.check([self._closed_key])

    def set_closed(self) -> None:
        """Close the run: later rounds raise ``RendezvousClosedError``.

        Before the first :meth:`next_rendezvous` (nothing connected), it
        closes this handler only.
        """
        self._closed_here = True
        if self._store is not None:
            self._store.set(self._closed_key, "1")

    def num_nodes_waiting(self) -> int:
        """Return 0: a static group never admits more nodes."""
        return 0

    def get_run_id(self) -> str:
        """Return the run identifier."""
        return self._run_id

    def shutdown(self) -> bool:
        """Close the connection (and, on rank 0, the store server); always True."""
        if self._store is not None:
            self._store.close()
        return True


def create_rdzv_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Build a :class:`StaticTCPRendezvous` from parameters (the ``static`` backend).

    Args:
        params: Endpoint ``host:port``, run id, the ``rank`` config key (as
            torch) or ``node_rank``, and ``max_nodes``.

    Returns:
        The handler (nothing is connected until its first round).

    Raises:
        ValueError: A parameter is missing or invalid; torch's message first.
    """
    return StaticTCPRendezvous(params)


create_handler = create_rdzv_handler
"""The tensorplay spec's name of :func:`create_rdzv_handler`."""
