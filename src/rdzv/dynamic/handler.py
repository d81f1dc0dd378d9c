"""The DynamicRendezvousHandler: the driver of the sans-I/O machine.

Theory of operation
-------------------
``next_rendezvous`` runs one :class:`~rdzv.dynamic.join.Join`: read what
the machine needs (state, queue length), ask
:func:`rdzv.dynamic.machine.decide` for the next action, apply it to the
backend, repeat. Waiting uses the backend's watch when it has one
(``WatchableBackend``), otherwise polling with jittered, capped backoff.
Every wait is bounded by the join deadline, so nothing hangs.

Each capability is adapted once, here: backends without the join-queue,
liveness or verdict capability get them from the handler's store
(``StoreJoinQueue``/``StoreLiveness``/``StoreVerdict``), so the shared state
still goes through the backend's compare-and-set, but joins, heartbeats and
verdicts never rewrite it; and the shared state's reads are the ones the
backend's capabilities allow (:func:`rdzv.dynamic.shared.shared_state`).

A keep-alive (:mod:`rdzv.dynamic.keepalive`) beats this node's heartbeat
from its first enqueue and evicts its ring successor once that one's mark
stands still for ``keep_alive_interval * keep_alive_max_attempt`` seconds
on this node's clock; survivors then see ``num_nodes_waiting() > 0``.

One clock (``clock``, real time by default) owns every deadline and every
wait: the join's, the keep-alive's, and every backend call of
``next_rendezvous``, which runs under the join deadline
(:func:`rdzv.retry.deadline_within`), as ``shutdown`` and ``set_closed``
run under their own few seconds (:func:`rdzv.retry.call_within`). So a
backend that stopped answering costs a call its deadline, never the
backend's read timeout, and a test on a fake clock sleeps nowhere.

Every transition is logged as one structured event on the ``rdzv.dynamic``
logger (no handlers attached: the application decides where logs go).

The parts: decisions in :mod:`rdzv.dynamic.machine`, wait lengths in
:mod:`rdzv.dynamic.pacing`, the join in :mod:`rdzv.dynamic.join`, this
node's rounds (the waiting count, leaving, the ring it judges) in
:mod:`rdzv.dynamic.member`, the shared state and its compare-and-set loop
in :mod:`rdzv.dynamic.shared`, the heartbeat and ring judgement in
:mod:`rdzv.dynamic.keepalive`. This module builds them and carries torch's
``RendezvousHandler`` surface.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from rdzv.api import (
    DEFAULT_KEEP_ALIVE_INTERVAL,
    DEFAULT_KEEP_ALIVE_MAX_ATTEMPT,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousSettings,
    RendezvousTimeout,
    given_node_rank,
)
from rdzv.backends.base import (
    BackendLike,
    JoinQueueBackend,
    LivenessBackend,
    RendezvousBackend,
    VerdictBackend,
    as_backend,
)
from rdzv.backends.kv import StoreJoinQueue, StoreLiveness, StoreVerdict
from rdzv.dynamic.admission import Admission
from rdzv.dynamic.admission_options import NodeAdmission, admission_from_params
from rdzv.dynamic.bootstrap import HeldPort
from rdzv.dynamic.confirm import check_period
from rdzv.dynamic.events import LOGGER, log_event, recorded_creation
from rdzv.dynamic.join import Join, JoinContext
from rdzv.dynamic.judging import judge_interval
from rdzv.dynamic.keepalive import KeepAlive
from rdzv.dynamic.machine import Limits
from rdzv.dynamic.member import Membership
from rdzv.dynamic.seat import Member, Seat
from rdzv.dynamic.shared import shared_state
from rdzv.dynamic.state import RendezvousState, make_node_key
from rdzv.errors import RendezvousConnectionError, RendezvousTimeoutError
from rdzv.keys import handler_prefix
from rdzv.net import advertised_address, primary_address
from rdzv.retry import Clock, as_clock, call_within, deadline_within
from rdzv.store.base import Store
from rdzv.store.foreign import StoreLike, as_store, caller_view

__all__ = ["DynamicRendezvousHandler", "HandlerStatistics", "create_handler"]


_SHUTDOWN_WITHIN = 5.0
"""Seconds ``shutdown`` waits for the backend before giving up on leaving cleanly."""
_JOIN_GRACE = 1.0
"""Seconds a backend call may run past the join deadline (the machine fails the join at it)."""


class DynamicRendezvousHandler(RendezvousHandler):
    """A rendezvous handler that forms rounds through a :class:`RendezvousBackend`.

    Build it with :meth:`from_backend` or :func:`create_handler`.

    Args:
        node: This handler's node key (``addr#pid#nonce``).
        settings: The rendezvous settings.
        backend_name: The name reported by :meth:`get_backend`.
        store: The store members get (prefixed per run and round): an rdzv
            store, or one with torch's ``Store`` API, wrapped once here
            (:func:`~rdzv.store.foreign.as_store`).
        backend: The backend holding the shared state: rdzv's, or one
            written against torch's ``RendezvousBackend``, wrapped once here
            (:func:`~rdzv.backends.base.as_backend`).
        local_addr: The address published for this node.
        node_rank: The rank this node asks for, or None.
        clock: The clock decisions, polls and keep-alive ticks run on (a
            bare monotonic reading sleeps in real time); real time when None.
        admission: The admission rules and this node's rank-order key value
            (:mod:`rdzv.dynamic.admission`); torch's rules when None.
    """

    def __init__(
        self,
        node: str,
        settings: RendezvousSettings,
        backend_name: str,
        store: StoreLike,
        backend: BackendLike,
        local_addr: str,
        node_rank: int | None = None,
        clock: Clock | Callable[[], float] | None = None,
        admission: NodeAdmission | None = None,
    ) -> None:
        store = as_store(store)
        backend = as_backend(backend)
        self._node = node
        self._settings = settings
        self._backend_name = backend_name
        self._store = store
        self._backend = backend
        self._clock = as_clock(clock)
        prefix = handler_prefix(settings.run_id)
        queue: JoinQueueBackend = (
            backend if isinstance(backend, JoinQueueBackend) else StoreJoinQueue(store, prefix)
        )
        # Confirmations of sealed rounds: the engine's own when it offers them.
        confirms = queue.confirmation_queue() or StoreJoinQueue(store, prefix).confirmation_queue()
        self._liveness: LivenessBackend = (
            backend if isinstance(backend, LivenessBackend) else StoreLiveness(store, prefix)
        )
        interval = settings.keep_alive_interval.total_seconds()
        dead_after = interval * settings.keep_alive_max_attempt
        timeout = settings.timeout
        admission = admission or NodeAdmission(Admission())
        low, high = admission.rules.bounds(settings.min_nodes, settings.max_nodes)
        self._limits = Limits(
            min_nodes=low,
            max_nodes=high,
            join_timeout=timeout.join.total_seconds(),
            last_call=timeout.last_call.total_seconds(),
            grace=dead_after,
            admission=admission.rules,
        )
        self._shared = shared_state(backend, backend_name, self._clock)
        # A round's confirmations wait in slices that keep the largest round within budget.
        verdicts: VerdictBackend = (
            confirms
            if isinstance(confirms, VerdictBackend)
            else StoreVerdict(
                store, prefix, self._shared.changed, check_period(settings.max_nodes, dead_after)
            )
        )
        self._members = Membership(
            node,
            store,
            prefix,
            self._shared,
            # The keep-alive's evictions must not wait behind this node's own
            # blocking watch on a client that serialises requests.
            shared_state(backend.side_channel(), backend_name, self._clock),
            queue,
            confirms,
            verdicts,
            self._limits,
            self._clock,
            self._event,
        )
        self._port = HeldPort(lambda exc: self._event("port-failed", -1, error=str(exc)))
        self._keepalive = KeepAlive(
            node,
            self._liveness,
            interval,
            settings.keep_alive_max_attempt,
            dead_after,
            judge_interval(interval, dead_after),
            self._clock,
            self._members.evict_dead,
            self._event,
        )
        self._join_context = JoinContext(
            node,
            -1 if node_rank is None else node_rank,
            local_addr,
            settings,
            self._limits,
            interval,
            self._clock,
            store,
            prefix,
            self._shared,
            queue,
            confirms,
            verdicts,
            self._liveness,
            self._members,
            self._port,
            self._keepalive,
            self._event,
            caller_view(store),
            admission.topology,
        )

    # -- construction -------------------------------------------------------

    @classmethod
    def from_backend(
        cls,
        run_id: str,
        store: StoreLike,
        backend: BackendLike,
        min_nodes: int,
        max_nodes: int,
        local_addr: str | None = None,
        timeout: RendezvousTimeout | None = None,
        keep_alive_interval: int | float | timedelta = DEFAULT_KEEP_ALIVE_INTERVAL,
        keep_alive_max_attempt: int = DEFAULT_KEEP_ALIVE_MAX_ATTEMPT,
        *,
        node_rank: int | None = None,
        clock: Clock | Callable[[], float] | None = None,
        admission: NodeAdmission | None = None,
    ) -> DynamicRendezvousHandler:
        """Build a handler for one run.

        Args:
            run_id: The run identifier.
            store: The store members get; also hosts joins and heartbeats when
                the backend lacks those capabilities. An rdzv store or one
                with torch's ``Store`` API (``torch.distributed.TCPStore``, ...).
            backend: The backend holding the shared state (rdzv's, or one
                with torch's ``RendezvousBackend`` API).
            min_nodes: The fewest nodes a round needs.
            max_nodes: The most nodes a round admits.
            local_addr: This node's address; found with ``getaddrinfo`` (never
                reverse DNS) when None.
            timeout: The timeouts; defaults when None.
            keep_alive_interval: Seconds (or a ``timedelta``) between heartbeats.
            keep_alive_max_attempt: Missed heartbeats before a node is dead.
            node_rank: The rank this node asks for; honoured when every node of
                a round asks for a distinct one.
            clock: The clock (see the class); real time when None.
            admission: The admission rules (see the class); torch's when None.

        Raises:
            ValueError: A setting is invalid; the message names it.
            TypeError: ``store`` or ``backend`` is of neither kind.
        """
        interval = (
            keep_alive_interval
            if isinstance(keep_alive_interval, timedelta)
            else timedelta(seconds=float(keep_alive_interval))
        )
        settings = RendezvousSettings(
            run_id,
            min_nodes,
            max_nodes,
            timeout or RendezvousTimeout(),
            interval,
            keep_alive_max_attempt,
        )
        return cls.from_settings(
            settings,
            store,
            backend,
            local_addr,
            node_rank=node_rank,
            clock=clock,
            admission=admission,
        )

    @classmethod
    def from_settings(
        cls,
        settings: RendezvousSettings,
        store: StoreLike,
        backend: BackendLike,
        local_addr: str | None = None,
        *,
        node_rank: int | None = None,
        clock: Clock | Callable[[], float] | None = None,
        admission: NodeAdmission | None = None,
    ) -> DynamicRendezvousHandler:
        """Build a handler from validated settings; the other arguments are :meth:`from_backend`'s.

        Raises:
            ValueError: ``node_rank`` is negative.
        """
        if node_rank is not None and (isinstance(node_rank, bool) or node_rank < 0):
            raise ValueError(f"node_rank must be a non-negative integer, got {node_rank!r}")
        addr = local_addr or primary_address()
        node = make_node_key(addr, os.getpid(), secrets.token_hex(4))
        return cls(node, settings, backend.name, store, backend, addr, node_rank, clock, admission)

    # -- small helpers ------------------------------------------------------

    @property
    def backend(self) -> RendezvousBackend:
        """The backend holding the shared state."""
        return self._backend

    @property
    def store(self) -> Store:
        """The store members get (rounds' stores are prefixes of it)."""
        return self._store

    @property
    def settings(self) -> RendezvousSettings:
        """The rendezvous settings."""
        return self._settings

    @property
    def node(self) -> str:
        """This handler's node key."""
        return self._node

    def _event(self, action: str, round_id: int, **fields: Any) -> None:
        if LOGGER.isEnabledFor(logging.INFO):
            log_event(self._settings.run_id, round_id, self._node, action, fields)

    def statistics(self) -> HandlerStatistics:
        """Return what this handler knows of its rounds now (no backend call)."""
        member = self._members.member
        return HandlerStatistics(
            None if member is None else member.round,
            self._keepalive.watched,
            self._keepalive.running,
            self._keepalive.error,
        )

    def round_participants(self) -> tuple[str, ...]:
        """Return the node keys of the round this node is a member of, in rank order.

        Empty when it is no member; read from the backend when this node
        learned its place from its seat alone.

        Raises:
            RendezvousStateError: The store no longer holds that round.
            RendezvousConnectionError: The backend cannot be reached.
        """
        member = self._members.member
        return () if member is None else self._members.participants_of(member)

    # -- the RendezvousHandler API -----------------------------------------

    def get_backend(self) -> str:
        """Return the backend name (``c10d``, ``etcd``, ...)."""
        return self._backend_name

    def get_run_id(self) -> str:
        """Return the run identifier."""
        return self._settings.run_id

    def next_rendezvous(self) -> RendezvousInfo:
        """Join the next round and block until it completes; return this node's view of it.

        Raises:
            RendezvousClosedError: The run is closed.
            RendezvousGracefulExitError: This node is a spare and the run closed.
            RendezvousExhaustedError: ``min_nodes`` never joined within the
                join timeout.
            RendezvousTimeoutError: The round did not seal within the join
                timeout although ``min_nodes`` joined.
            RendezvousConnectionError: The backend or store cannot be reached,
                or this node's heartbeats failed.
            RendezvousStateError: The stored state is corrupt.
        """
        join = self._limits.join_timeout + _JOIN_GRACE
        try:
            # Backend calls honour this deadline (rdzv.retry), so a backend that
            # stopped answering costs the join its timeout, not the read timeout.
            with self._clock.running(), deadline_within(join, self._clock):
                return Join(self._join_context).run()
        except BaseException:
            # A node whose join failed is no candidate: its beats would keep
            # it looking alive to the others. The next join starts them again.
            self._keepalive.stop()
            self._port.release()
            raise

    def is_closed(self) -> bool:
        """Tell whether the run is closed (any node called :meth:`set_closed`)."""
        state, _ = self._shared.read()
        return state is not None and state.closed

    def set_closed(self) -> None:
        """Close the run; joins fail with ``RendezvousClosedError`` afterwards.

        It returns within the close timeout whatever the backend does.

        Raises:
            RendezvousTimeoutError: The close did not go through within the
                close timeout (a backend that does not answer included).
            RendezvousConnectionError: The backend cannot be reached.
        """
        within = self._settings.timeout.close.total_seconds()
        what = f"closing the run {self._settings.run_id!r}"
        call_within(within, what, self._close_run, self._clock)

    def _close_run(self) -> None:
        def close(state: RendezvousState | None) -> RendezvousState | None:
            return (
                None if state is not None and state.closed else (state or RendezvousState()).close()
            )

        deadline = self._clock() + self._settings.timeout.close.total_seconds()
        written, settled = self._shared.update(close, deadline)
        if not settled:
            raise RendezvousTimeoutError(
                f"could not close the rendezvous {self._settings.run_id!r} in time"
            )
        if written is not None:
            self._event("closed", written.round)

    def num_nodes_waiting(self) -> int:
        """Return how many nodes wait for a new round.

        A positive number tells a member to re-rendezvous: nodes wait and the
        round has room, a member died or left, or the store lost the round
        (restarted empty). A member reads the backend at most once per
        :func:`~rdzv.dynamic.pacing.waiting_poll_gap` of its round and answers from its last reading in
        between, so agents asking every 0.1 s keep one store host's load
        bounded whatever the size (torch serves its state for 1 s).

        Dead or departed members count; for a node that is no member, the
        answer is the length of the next round's queue.

        Raises:
            RendezvousConnectionError: The backend cannot be reached, or this
                node's heartbeats failed ``keep_alive_max_attempt`` times.
        """
        self._keepalive.check()
        return self._members.nodes_waiting()

    def pre_shutdown(self) -> None:
        """Stop sending heartbeats (the first half of :meth:`shutdown`)."""
        self._keepalive.stop()

    def shutdown(self) -> bool:
        """Leave the run: stop heartbeats and remove this node from its round.

        The run stays open, so the other nodes can re-form without this one.
        It returns within a few seconds whatever the backend does: True if
        the node left cleanly; False if the backend could not be reached (the
        others then detect it by its missing heartbeats).
        """
        self._keepalive.stop()
        self._port.release()
        member = self._members.take()
        what = f"node {self._node} leaving"
        try:
            call_within(_SHUTDOWN_WITHIN, what, lambda: self._leave(member), self._clock)
        except (RendezvousConnectionError, RendezvousTimeoutError) as exc:
            LOGGER.warning("rdzv shutdown of %s did not reach the backend: %s", self._node, exc)
            return False
        self._event("shutdown", -1 if member is None else member.round)
        return True

    def _leave(self, member: Member | None) -> None:
        if member is not None:
            self._members.evict([self._node], member.round)
        self._liveness.forget(self._node)

    def close(self) -> None:
        """Stop heartbeats and close the backend and store this handler was given.

        Call it once the handler is done (after :meth:`shutdown` or
        :meth:`set_closed`); the handler, its backend and its store are not
        used after. It does not leave the round: a node that closes without
        ``shutdown`` is found dead by its missing heartbeats.
        """
        self._keepalive.stop()
        self._port.release()
        try:
            self._backend.close()
        finally:
            self._store.close()


@dataclass(frozen=True)
class HandlerStatistics:
    """What a handler knows of its rounds (:meth:`DynamicRendezvousHandler.statistics`).

    Attributes:
        round: The round this node is a member of, or None.
        watched: Its seat in the round whose ring its keep-alive judges, or None.
        keepalive_running: Whether its keep-alive runs.
        keepalive_error: Why its keep-alive gave up, until it starts again; or None.
    """

    round: int | None
    watched: Seat | None
    keepalive_running: bool
    keepalive_error: RendezvousConnectionError | None


def create_handler(
    store: StoreLike,
    backend: BackendLike,
    params: RendezvousParameters,
    admission: NodeAdmission | None = None,
) -> DynamicRendezvousHandler:
    """Build a :class:`DynamicRendezvousHandler` from rendezvous parameters.

    Like torch's, it builds through :meth:`DynamicRendezvousHandler.from_backend`
    (a patched ``from_backend`` is the one called).

    The settings come from :meth:`RendezvousSettings.from_params
    <rdzv.api.RendezvousSettings.from_params>` (``join_timeout``,
    ``last_call_timeout``, ``close_timeout``, ``heartbeat``,
    ``keep_alive_interval``, ``keep_alive_max_attempt``).

    Args:
        store: The store members get (an rdzv store or a torch store).
        backend: The backend holding the shared state.
        params: The parameters (``run_id``, ``min_nodes``, ``max_nodes``,
            ``local_addr`` (without it, the address facing the endpoint:
            :func:`rdzv.net.advertised_address`), ``node_rank`` when the caller
            gave it, config).
        admission: The admission rules, when the caller parsed them
            already; else read from ``params`` (:mod:`rdzv.dynamic.admission_options`).

    The handler's :meth:`~DynamicRendezvousHandler.close` closes ``backend`` and ``store``.

    As torch's ``create_handler`` records an event and raises when it
    fails, a failure here is logged as the event ``create-failed``
    (:func:`~rdzv.dynamic.events.recorded_creation`), then raised; under torchrun it reaches
    torch's event handler too (:mod:`rdzv.torchrun.events`).

    Raises:
        ValueError: A parameter is invalid; the message names it.
        TypeError: ``store`` or ``backend`` is of neither kind.
    """
    with recorded_creation(params.run_id):
        settings = RendezvousSettings.from_params(params)
        return DynamicRendezvousHandler.from_backend(
            settings.run_id,
            store,
            backend,
            settings.min_nodes,
            settings.max_nodes,
            params.local_addr or advertised_address(params.endpoint),
            settings.timeout,
            settings.keep_alive_interval,
            settings.keep_alive_max_attempt,
            node_rank=given_node_rank(params),
            admission=admission or admission_from_params(params, os.environ),
        )
