"""The DynamicRendezvousHandler: the driver of the sans-I/O machine.

Theory of operation
-------------------
``next_rendezvous`` loops: read what the machine needs (state, queue
length), ask :func:`rdzv.dynamic.machine.decide` for the next action, apply
it to the backend, repeat. Waiting uses the backend's watch when it has one
(``WatchableBackend``), otherwise polling with jittered, capped backoff.
Every wait is bounded by the join deadline, so nothing hangs. On a backend
that stores seats (``SeatedBackend``) the loop decides on the state's
summary until this node's round is sealed (:data:`rdzv.dynamic.machine.StateView`),
waits for a seal that seats it, and reads the state itself only to seal
or when a round was sealed without a seat for it (:mod:`rdzv.dynamic.seat`).

Backends without the join-queue or liveness capability get them from the
handler's store (``StoreJoinQueue``/``StoreLiveness``): the shared state
still goes through the backend's compare-and-set, but joins and heartbeats
never rewrite it.

A keep-alive (:class:`~rdzv.dynamic.keepalive.KeepAlive`) starts when this
node first enqueues. Every ``keep_alive_interval`` it bumps this node's
heartbeat mark; more often it reads the mark of its ring successor in the
last round it completed (rank ``r`` watches the next live rank; it keeps
watching while it re-joins, until it completes another round), and when
that mark has not changed for ``keep_alive_interval * keep_alive_max_attempt``
seconds on THIS node's monotonic clock (time in which this node could not
read counts at most one interval), it evicts the successor with one
compare-and-set. Wall clocks are never read. Survivors then see
``num_nodes_waiting() > 0``. If this node's own heartbeats fail
``keep_alive_max_attempt`` times in a row, the keep-alive stops and calls
raise ``RendezvousConnectionError`` until the node joins again; a join that
fails stops the heartbeats too.

The bootstrap address (``MASTER_ADDR``/``MASTER_PORT``) comes with the
seal: every joining node binds a free port and holds it (bound, not
listening, so no other process takes it) and names it in its join record;
the sealer copies rank 0's port into the sealed state, and ``MASTER_ADDR``
is the address in rank 0's node key. No member waits for rank 0 after the
seal. Each node lets its port go when it completes (rank 0's workers then
serve on it) or fails; rank 0 also writes the two keys into the round's
store, as torch's rank 0 does, for readers that look there.

A state sealed without a port (by an older rdzv, or with a rank 0 that
found no free port to hold) falls back to waiting: a member of rank > 0
waits for rank 0 to publish the keys in short slices, checking between
them that rank 0 is still a live member of the round, until the join
deadline at most. If
rank 0 died after the seal and before publishing, its ring predecessor
evicts it and this member joins the next round at once instead of waiting
out the store timeout.

Every backend call of ``next_rendezvous`` runs under the join deadline
(:func:`rdzv.retry.deadline_within`), and ``shutdown`` and ``set_closed``
under their own few seconds (:func:`rdzv.retry.call_within`), so a backend
that stopped answering costs a call its deadline, never the backend's read
timeout.

Every transition is logged as one structured event on the ``rdzv.dynamic``
logger (no handlers attached: the application decides where logs go).

Size: this module is longer than the project's ~600-line guide because it
carries torch's whole ``RendezvousHandler`` surface (three ways to build a
handler, join, close, leave, the waiting count) with its documentation. Its
parts live elsewhere: every decision in :mod:`rdzv.dynamic.machine`, the
shared state and its compare-and-set loop in :mod:`rdzv.dynamic.shared`,
the heartbeat and ring judgement in :mod:`rdzv.dynamic.keepalive`.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from functools import partial
from typing import Any

from rdzv.api import (
    DEFAULT_KEEP_ALIVE_INTERVAL,
    DEFAULT_KEEP_ALIVE_MAX_ATTEMPT,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousSettings,
    RendezvousStoreInfo,
    RendezvousTimeout,
)
from rdzv.backends.base import (
    JoinQueueBackend,
    LivenessBackend,
    RendezvousBackend,
    Token,
)
from rdzv.backends.kv import StoreJoinQueue, StoreLiveness, store_call
from rdzv.dynamic.confirm import (
    RoundConfirmation,
    check_period,
    drop_confirmation,
    member_lost,
)
from rdzv.dynamic.keepalive import KeepAlive
from rdzv.dynamic.machine import (
    Complete,
    Enqueue,
    Fail,
    FailReason,
    JoinProgress,
    Limits,
    MarkWatch,
    Requeue,
    Seal,
    SealJudging,
    StateView,
    Wait,
    bootstrap_abandoned,
    decide,
    droppable_queue,
    judge_interval,
    judge_marks,
    leaving_members,
    missing_members,
    nodes_waiting,
    nodes_waiting_unchanged,
    observe,
    plan_seal,
    round_lost,
    start_join,
)
from rdzv.dynamic.pacing import queue_wait, seat_wait, state_wait, waiting_poll_gap
from rdzv.dynamic.seat import Seat, seats_of, watching_seat
from rdzv.dynamic.shared import SharedState
from rdzv.dynamic.state import (
    JoinRecord,
    RendezvousState,
    StateSummary,
    decode_record,
    decode_state,
    encode_record,
    encode_state,
    make_node_key,
    node_address,
)
from rdzv.errors import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousExhaustedError,
    RendezvousGracefulExitError,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from rdzv.net import advertised_address, primary_address
from rdzv.retry import Clock, as_clock, call_within, caller_deadline, deadline_within, jitter
from rdzv.store.base import Store
from rdzv.store.memory import PrefixStore

__all__ = ["DynamicRendezvousHandler", "create_handler"]

LOGGER = logging.getLogger("rdzv.dynamic")

_SHUTDOWN_WITHIN = 5.0
"""Seconds ``shutdown`` waits for the backend before giving up on leaving cleanly."""
_JOIN_GRACE = 1.0
"""Seconds a backend call may run past the join deadline (the machine fails the join at it)."""
_BOOTSTRAP_CHECK = 0.5
"""Seconds between checks that rank 0 is still a member while waiting for its address."""


class DynamicRendezvousHandler(RendezvousHandler):
    """A rendezvous handler that forms rounds through a :class:`RendezvousBackend`.

    Build it with :meth:`from_backend` or :func:`create_handler`.

    Args:
        node: This handler's node key (``addr#pid#nonce``).
        settings: The rendezvous settings.
        backend_name: The name reported by :meth:`get_backend`.
        store: The store members get (prefixed per run and round).
        backend: The backend holding the shared state.
        local_addr: The address published for this node.
        node_rank: The rank this node asks for, or None.
        clock: The clock decisions, polls and keep-alive ticks run on (a
            bare monotonic reading sleeps in real time); real time when None.
    """

    def __init__(
        self,
        node: str,
        settings: RendezvousSettings,
        backend_name: str,
        store: Store,
        backend: RendezvousBackend,
        local_addr: str,
        node_rank: int | None = None,
        clock: Clock | Callable[[], float] | None = None,
    ) -> None:
        self._node = node
        self._settings = settings
        self._backend_name = backend_name
        self._store = store
        self._backend = backend
        self._local_addr = local_addr
        self._node_rank = -1 if node_rank is None else node_rank
        self._clock = as_clock(clock)
        prefix = f"rdzv.handler/{settings.run_id}/"
        self._prefix = prefix
        self._queue: JoinQueueBackend = (
            backend if isinstance(backend, JoinQueueBackend) else StoreJoinQueue(store, prefix)
        )
        # Confirmations of sealed rounds: the engine's own when it offers them.
        self._confirms = (
            self._queue.confirmation_queue() or StoreJoinQueue(store, prefix).confirmation_queue()
        )
        self._liveness: LivenessBackend = (
            backend if isinstance(backend, LivenessBackend) else StoreLiveness(store, prefix)
        )
        interval = settings.keep_alive_interval.total_seconds()
        self._interval = interval
        self._dead_after = interval * settings.keep_alive_max_attempt
        self._judge_every = judge_interval(interval, self._dead_after)
        timeout = settings.timeout
        self._limits = Limits(
            min_nodes=settings.min_nodes,
            max_nodes=settings.max_nodes,
            join_timeout=timeout.join.total_seconds(),
            last_call=timeout.last_call.total_seconds(),
            grace=self._dead_after,
        )
        self._shared = SharedState(backend, backend_name, self._clock)
        # The keep-alive's evictions must not wait behind this node's own
        # blocking watch on a client that serialises requests.
        self._side = SharedState(backend.side_channel(), backend_name, self._clock)
        self._lock = threading.Lock()
        self._held_port: socket.socket | None = None
        self._member_of: _Membership | None = None
        # This node's seat in the last round it completed: its ring successor
        # there is watched until the node completes another round
        # (re-joining does not stop it), so a member that dies while the
        # others re-join is still found by its ring predecessor.
        self._watched: Seat | None = None
        # The round whose queues this node's last seal made droppable.
        self._dropping: int | None = None
        # The last answer of num_nodes_waiting: (membership, when, answer).
        self._waiting_answer: tuple[_Membership, float, int] | None = None
        self._keepalive = KeepAlive(
            node,
            self._liveness,
            interval,
            settings.keep_alive_max_attempt,
            self._dead_after,
            self._judge_every,
            self._clock,
            self._watched_round,
            self._evict_dead,
            self._event,
        )

    # -- construction -------------------------------------------------------

    @classmethod
    def from_backend(
        cls,
        run_id: str,
        store: Store,
        backend: RendezvousBackend,
        min_nodes: int,
        max_nodes: int,
        local_addr: str | None = None,
        timeout: RendezvousTimeout | None = None,
        keep_alive_interval: int | float | timedelta = DEFAULT_KEEP_ALIVE_INTERVAL,
        keep_alive_max_attempt: int = DEFAULT_KEEP_ALIVE_MAX_ATTEMPT,
        *,
        node_rank: int | None = None,
        clock: Clock | Callable[[], float] | None = None,
    ) -> DynamicRendezvousHandler:
        """Build a handler for one run.

        Args:
            run_id: The run identifier.
            store: The store members get; also hosts joins and heartbeats when
                the backend lacks those capabilities.
            backend: The backend holding the shared state.
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

        Returns:
            The handler.

        Raises:
            ValueError: A setting is invalid; the message names it.
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
            settings, store, backend, local_addr, node_rank=node_rank, clock=clock
        )

    @classmethod
    def from_settings(
        cls,
        settings: RendezvousSettings,
        store: Store,
        backend: RendezvousBackend,
        local_addr: str | None = None,
        *,
        node_rank: int | None = None,
        clock: Clock | Callable[[], float] | None = None,
    ) -> DynamicRendezvousHandler:
        """Build a handler from validated settings.

        Args:
            settings: The rendezvous settings.
            store: The store members get; also hosts joins and heartbeats when
                the backend lacks those capabilities.
            backend: The backend holding the shared state.
            local_addr: This node's address; found with ``getaddrinfo`` (never
                reverse DNS) when None.
            node_rank: The rank this node asks for, or None.
            clock: The clock (see the class); real time when None.

        Returns:
            The handler.

        Raises:
            ValueError: ``node_rank`` is negative.
        """
        if node_rank is not None and (isinstance(node_rank, bool) or node_rank < 0):
            raise ValueError(f"node_rank must be a non-negative integer, got {node_rank!r}")
        addr = local_addr or primary_address()
        node = make_node_key(addr, os.getpid(), secrets.token_hex(4))
        return cls(
            node,
            settings,
            backend.name,
            store,
            backend,
            addr,
            node_rank,
            clock,
        )

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
        if not LOGGER.isEnabledFor(logging.INFO):
            return
        event = {
            "run_id": self._settings.run_id,
            "round": round_id,
            "node": self._node,
            "action": action,
            **fields,
        }
        LOGGER.info("rdzv %s", _EventText(event), extra={"rdzv_event": event})

    def _check_keepalive(self) -> None:
        error = self._keepalive.error
        if error is not None:
            raise error

    def _config(self) -> str:
        s = self._settings
        return f"run_id={s.run_id} min_nodes={s.min_nodes} max_nodes={s.max_nodes}"

    # -- the RendezvousHandler API -----------------------------------------

    def get_backend(self) -> str:
        """Return the backend name (``c10d``, ``etcd``, ...)."""
        return self._backend_name

    def get_run_id(self) -> str:
        """Return the run identifier."""
        return self._settings.run_id

    def next_rendezvous(self) -> RendezvousInfo:
        """Join the next round and block until it completes.

        Returns:
            This node's view of the round: its store, rank, world size,
            bootstrap store, participants and wait list.

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
        try:
            # Backend calls honour this deadline (rdzv.retry), so a backend that
            # stopped answering costs the join its timeout, not the read timeout.
            with deadline_within(self._limits.join_timeout + _JOIN_GRACE):
                return self._join()
        except BaseException:
            # A node whose join failed is no candidate: its beats would keep
            # it looking alive to the others. The next join starts them again.
            self._stop_keepalive()
            self._release_port()
            raise

    def _join(self) -> RendezvousInfo:
        self._leave_round()
        # Until this node's round is sealed, the state's summary decides as
        # the state would (rdzv.dynamic.machine.StateView).
        state, token = self._shared.read_view()
        now = self._clock()
        progress = start_join(state, now)
        queue_length = 0
        attempt = 0
        suspects: list[str] = []
        excluded: set[str] = set()
        watches: dict[str, MarkWatch] = {}
        judging = SealJudging()
        reported = 0
        seated: _Membership | None = None
        self._event("join", progress.round_id)
        while True:
            progress = observe(progress, state, queue_length, self._limits, now)
            action = (
                Complete(seated.seat.rank)
                if seated is not None
                else decide(progress, state, queue_length, self._node, self._limits, now)
            )
            if isinstance(action, Complete):
                member = seated
                if member is None:
                    # decide() completes on a state, never on a summary.
                    assert isinstance(state, RendezvousState)
                    member = _Membership.of(state, token, self._node)
                info = self._complete(member, progress.deadline(self._limits))
                if info is not None:
                    return info
                # A member was lost before every member confirmed, or rank 0
                # left before publishing its address: join the next round,
                # still within this call's join deadline.
                self._leave_round()
                state, token = self._shared.read_view()
                now = self._clock()
                progress = replace(start_join(state, now), started_at=progress.started_at)
                queue_length, suspects, judging, excluded = 0, [], SealJudging(), set()
                seated = None
                self._event("join", progress.round_id)
                continue
            if isinstance(action, Fail):
                self._fail(action.reason, progress)
            if isinstance(action, Enqueue):
                record = encode_record(JoinRecord(self._node, self._node_rank, self._hold_port()))
                position = self._queue.enqueue(action.round_id, record)
                progress = replace(progress, position=position)
                queue_length = max(queue_length, position)
                self._start_keepalive()
                self._event("enqueue", action.round_id, position=position)
            elif isinstance(action, Requeue):
                self._event("requeue", action.round_id, missed=progress.round_id)
                progress = JoinProgress(action.round_id, progress.started_at)
                queue_length, judging, excluded = 0, SealJudging(), set()
            elif isinstance(action, Seal):
                if isinstance(state, StateSummary):
                    # The seal needs the participants: decide again on the state.
                    state, token = self._shared.read()
                    continue
                state, token, progress, suspects = self._seal(
                    state, token, progress, queue_length, excluded
                )
            elif isinstance(action, Wait):
                remaining = max(0.0, action.deadline - now)
                if action.on_queue:
                    queue_length = self._queue.wait_queue_length(
                        progress.round_id, queue_length, queue_wait(remaining)
                    )
                    if suspects:
                        due, judging = judging.due(
                            progress.position, self._limits, self._clock(), self._interval
                        )
                        if due:
                            # A seal deferred on the state it read: not a summary.
                            assert not isinstance(state, StateSummary)
                            watches = self._judge_suspects(state, suspects, watches, excluded)
                    state, token = self._shared.read()
                else:
                    state, token, seated = self._wait_state(
                        state,
                        token,
                        progress.round_id,
                        state_wait(remaining, queue_length, jitter(1.0, 1.5)),
                        attempt,
                        max(0.0, progress.deadline(self._limits) - now),
                    )
                    attempt += 1
                    if seated is None and (state is None or state.round < progress.round_id):
                        # A sealed round decides without the queue: one
                        # request fewer for each of its members.
                        queue_length = self._queue.queue_length(progress.round_id)
                if queue_length != reported:
                    # Progress for whoever waits with this node (rdzv run prints it).
                    reported = queue_length
                    self._event(
                        "waiting",
                        progress.round_id,
                        joined=queue_length,
                        min_nodes=self._limits.min_nodes,
                        max_nodes=self._limits.max_nodes,
                        timeout_in=round(progress.deadline(self._limits) - self._clock(), 3),
                    )
            now = self._clock()

    def _wait_state(
        self,
        state: StateView | None,
        token: Token | None,
        round_id: int,
        timeout: float,
        attempt: int,
        join_left: float,
    ) -> tuple[StateView | None, Token | None, _Membership | None]:
        """Wait for the state to change; on a seated backend, read this node's seat first.

        A node seated in ``round_id`` by the new token is a member without
        reading the participant list. Otherwise the new write's summary is
        read, and the state whole only when that write sealed ``round_id``
        or a later round (a summary cannot tell a member) or stored none.
        Once the summary says ``round_id`` is sealed, this node waits up to
        :func:`~rdzv.dynamic.pacing.seat_wait` for its seat, ``timeout`` or not, but never past
        ``join_left`` (the seconds left before the join deadline).

        Returns:
            ``(state, token, membership)``: the membership when a seat of
            ``round_id`` was found (``state`` is then the one before).
        """
        if not self._shared.seated:
            return (*self._shared.wait(token, timeout, attempt), None)
        current, seat = self._shared.wait_seat(token, timeout, self._node)
        if seat is not None and seat.round == round_id:
            return state, token, self._seated(seat, current)
        if current == token:
            return state, token, None
        summary = None if current is None else self._shared.read_summary(current)
        if summary is None and current is not None:
            # A later write replaced the summary read for: members that
            # re-join together race with the leave and the eviction of the
            # dead (in a recovery of 1,024 beside a second one, dozens read
            # the 28 KB state for it). Read the newest write's.
            view, current = self._shared.read_view()
            if not isinstance(view, StateSummary):
                return view, current, None
            summary = view
        if summary is not None and summary.round < round_id:
            return summary, current, None
        if summary is not None and summary.round == round_id and not summary.closed:
            # Sealed, and members' seats follow the seal's compare-and-set:
            # this node's may be on its way (at 8,192 nodes, those that
            # looked in between read the 240 KB state, thousands at once).
            seating, seat = self._shared.wait_seat(token, seat_wait(join_left), self._node)
            if seat is not None and seat.round == round_id:
                return state, token, self._seated(seat, seating)
        return (*self._shared.read(), None)

    def _seated(self, seat: Seat, token: Token) -> _Membership:
        """Return the membership of a seat just read, its sealed mark stamped with the time."""
        sealed = seat.sealed_mark
        if sealed is not None:
            seat = replace(seat, sealed_mark=replace(sealed, read_at=self._clock()))
        return _Membership(seat, token, None)

    def _judge_suspects(
        self,
        state: RendezvousState | None,
        suspects: list[str],
        watches: dict[str, MarkWatch],
        excluded: set[str],
    ) -> dict[str, MarkWatch]:
        """Judge the nodes a deferred seal waits for or would admit; return the watches.

        The dead members of the last round are evicted; every node judged
        dead is added to ``excluded``, which the seal leaves out: a node that
        died in the queue while the seal waited is in no round sealed later.
        """
        marks = self._liveness.heartbeat_marks(suspects)
        watches, dead = judge_marks(watches, marks, self._clock(), self._dead_after, self._interval)
        if dead:
            round_id = state.round if state is not None else -1
            self._event("dead", round_id, suspects=dead)
            excluded.update(dead)
            if state is not None and set(dead) & set(state.live_participants()):
                self._evict(dead, state.round)
        return watches

    def _seal(
        self,
        state: RendezvousState | None,
        token: Token | None,
        progress: JoinProgress,
        queue_length: int,
        excluded: set[str],
    ) -> tuple[RendezvousState | None, Token | None, JoinProgress, list[str]]:
        """Seal the round, or defer it and return the nodes to judge meanwhile.

        Those are the members of the last round that have not re-joined, and
        the other queued nodes: one that dies in the queue while the seal
        waits is judged and left out (``excluded``).
        """
        round_id = progress.round_id
        records = [
            r
            for r in (decode_record(r) for r in self._queue.queue_records(round_id))
            if r.node not in excluded
        ]
        plan = plan_seal(state, round_id, records, self._limits)
        if plan is None:
            missing = missing_members(state, records)
            self._event("seal-deferred", round_id, queued=len(records), missing=len(missing))
            queued = [r.node for r in records if r.node != self._node and r.node not in missing]
            blocked = replace(progress, blocked=(queue_length, state))
            return state, token, blocked, missing + list(dict.fromkeys(queued))
        # The seats let each member learn its place without the participant
        # list, on a backend that stores them; a seal that does not know rank
        # 0's port stores none (every member then reads the state and waits
        # for rank 0's address).
        seats = (
            seats_of(plan, self._sealed_marks(plan))
            if plan.bootstrap_port and self._shared.seated
            else None
        )
        encoded = encode_state(plan)
        result = self._shared.write(plan, encoded, token, seats)
        if result is None:
            return None, None, progress, []
        new_state, new_token, written = result
        if written:
            self._event("sealed", round_id, world_size=len(plan.participants))
            if seats:
                # The round's list for members that ask (RendezvousInfo.participants),
                # kept as long as its join queue: written before this node
                # confirms, so before any member completes.
                key = _round_key(self._prefix, round_id)
                store_call("seal", lambda: self._store.set(key, encoded))
            # Dropped once this node confirmed (_complete): requests with a
            # reply sent now would queue behind every member's confirmation,
            # and the round's verdict waits for this node's too.
            self._dropping = droppable_queue(round_id)
            return plan, new_token, progress, []
        return decode_state(new_state), new_token, progress, []

    def _sealed_marks(self, plan: RendezvousState) -> dict[str, bytes | None] | None:
        """Read the marks of ``plan``'s members for their seats (:class:`~rdzv.dynamic.seat.SealedMark`).

        One read; a failed one leaves the seats without marks (the members
        then judge from their own first readings, as before). The marks only
        make judgements sooner, so no failure of this read, of any kind (a
        third-party backend's bug too), stops the seal.
        """
        try:
            return self._liveness.heartbeat_marks(plan.live_participants())
        except Exception as exc:  # noqa: BLE001 - best effort: the seal goes on without marks
            self._event("marks-failed", plan.round, error=f"{type(exc).__name__}: {exc}")
            return None

    def _fail(self, reason: FailReason, progress: JoinProgress) -> None:
        self._event("fail", progress.round_id, reason=reason.value)
        if reason is FailReason.CLOSED:
            raise RendezvousClosedError(f"the rendezvous {self._settings.run_id!r} is closed")
        if reason is FailReason.GRACEFUL_EXIT:
            raise RendezvousGracefulExitError(
                f"node {self._node} is a spare of the closed run {self._settings.run_id!r}"
            )
        join = self._limits.join_timeout
        if reason is FailReason.EXHAUSTED:
            raise RendezvousExhaustedError(self._config(), join)
        raise RendezvousTimeoutError(
            f"round {progress.round_id} of {self._config()} did not complete within the "
            f"join timeout of {join:g} s"
        )

    def _complete(self, member: _Membership, join_deadline: float) -> RendezvousInfo | None:
        """Become a member of the sealed round; None if it broke before it completed.

        It breaks when a member is lost before every member confirmed, or
        rank 0 left before publishing its address.
        """
        seat = member.seat
        # A node whose heartbeats gave up is as good as dead to the others:
        # it joins no round (nor completes one it confirmed meanwhile, below).
        self._check_keepalive()
        with self._lock:
            self._member_of = member
        store = PrefixStore(f"rdzv/{self._settings.run_id}/round/{seat.round}", self._store)
        self._release_port()
        confirmed = seat.world_size == 1 or self._confirm(member, join_deadline)
        # The ring judging starts at the verdict, or at the confirmation's
        # first late slice (see _confirm), whichever comes first.
        self._judge_ring(seat)
        self._drop_old_round()
        if not confirmed:
            self._event("broken", seat.round, rank=seat.rank, reason="a member was lost")
            return None
        self._check_keepalive()
        bootstrap: RendezvousStoreInfo | None = None
        if seat.port:
            bootstrap = RendezvousStoreInfo(node_address(seat.master), seat.port)
        elif seat.rank != 0:
            # Only a state read whole lacks the port: stored seats name it.
            assert member.state is not None
            if not self._await_bootstrap(member.state, seat.rank, store):
                self._event(
                    "broken", seat.round, rank=seat.rank, reason="rank 0 left before publishing"
                )
                return None
        self._event("complete", seat.round, rank=seat.rank, world_size=seat.world_size)
        if bootstrap is None or seat.rank == 0:
            bootstrap = RendezvousStoreInfo.build(
                seat.rank,
                store,
                local_addr=bootstrap.master_addr if bootstrap else self._local_addr,
                server_port=bootstrap.master_port if bootstrap else None,
            )
        return RendezvousInfo(
            store,
            seat.rank,
            seat.world_size,
            bootstrap,
            # Both read on first use: a member of thousands learns its place
            # from its seat, and reads lists only when asked.
            lambda: [node_address(n) for n in self._participants_of(member)],
            lambda: [
                node_address(decode_record(r).node)
                for r in self._queue.queue_records(seat.round + 1)
            ],
        )

    def _drop_old_round(self) -> None:
        """Delete the queues and keys of the round this node's last seal made droppable.

        Garbage collection: a store that fails it keeps the garbage, and the
        round goes on (an event says so).
        """
        dropped, self._dropping = self._dropping, None
        if dropped is None:
            return
        try:
            self._queue.drop_queue(dropped)
            drop_confirmation(self._confirms, self._store, self._prefix, dropped)
            for key in (_leave_key(self._prefix, dropped), _round_key(self._prefix, dropped)):
                store_call("drop", partial(self._store.delete_key, key))
        except RendezvousConnectionError as exc:
            self._event("drop-failed", dropped, error=str(exc))

    def _participants_of(self, member: _Membership) -> tuple[str, ...]:
        """Return the node keys of ``member``'s round in rank order, reading the state if needed.

        Raises:
            RendezvousStateError: The store no longer holds that round.
            RendezvousConnectionError: The backend cannot be reached.
        """
        if member.state is not None:
            return member.state.participants
        key = _round_key(self._prefix, member.round)
        raw = store_call("participants", lambda: self._store.try_multi_get([key]))[0]
        state = decode_state(raw) if raw is not None else self._shared.read()[0]
        if state is None or state.round != member.round:
            now = "nothing" if state is None else f"round {state.round}"
            raise RendezvousStateError(
                f"the participants of round {member.round} are no longer stored "
                f"(the store holds {now}); read RendezvousInfo.participants before "
                "the next round"
            )
        return state.participants

    def _confirm(self, member: _Membership, join_deadline: float) -> bool:
        """Confirm the sealed round (:mod:`rdzv.dynamic.confirm`); False once a member is lost.

        Raises:
            RendezvousTimeoutError: Not every member confirmed within the
                join timeout, and none was evicted.
        """
        seat = member.seat
        confirmation = RoundConfirmation(
            self._confirms,
            self._store,
            self._prefix,
            seat.round,
            seat.world_size,
            lambda: self._participants_of(member),
        )
        confirmation.confirm(self._node)
        period = check_period(seat.world_size, self._dead_after)
        ring_judging = False
        while not confirmation.wait(period):
            if not ring_judging:
                # No verdict within a slice: a member may have died in the
                # queue, and its ring predecessor must judge it. Until now
                # the ring's first readings would only have competed with
                # the confirmations of a large round.
                self._judge_ring(seat)
                ring_judging = True
            # The token alone tells a seated member that nothing changed.
            changed, current = self._shared.changed_since(member.token)
            if changed and member_lost(seat.round, seat.world_size, current):
                return False
            real_deadline = caller_deadline()
            if self._clock() >= join_deadline or (
                real_deadline is not None and time.monotonic() >= real_deadline
            ):
                missing = confirmation.unconfirmed()
                size = seat.world_size
                raise RendezvousTimeoutError(
                    f"round {seat.round} of {self._config()}: {size - len(missing)} of {size} "
                    f"members confirmed it within the join timeout of "
                    f"{self._limits.join_timeout:g} s; not confirmed: " + _some_nodes(missing)
                )
        return True

    def _await_bootstrap(self, state: RendezvousState, rank: int, store: Store) -> bool:
        """Wait for rank 0's bootstrap address; False once rank 0 is no live member.

        Raises:
            RendezvousTimeoutError: Rank 0 stayed a member but did not publish
                within the store timeout, or by the join deadline when that
                comes sooner.
        """
        # The store's own timeout runs on real time, whatever clock the machine uses.
        started = time.monotonic()
        timeout = store.timeout.total_seconds()
        deadline, bound = started + timeout, f"within {timeout:g} s"
        join_deadline = caller_deadline()
        if join_deadline is not None and join_deadline < deadline:
            deadline = join_deadline
            bound = f"by the join deadline ({max(0.0, deadline - started):.3g} s of waiting)"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RendezvousTimeoutError(
                    f"rank {rank} did not see rank 0 publish MASTER_ADDR/MASTER_PORT {bound}"
                )
            try:
                store.wait(
                    [RendezvousStoreInfo.MASTER_ADDR_KEY, RendezvousStoreInfo.MASTER_PORT_KEY],
                    timedelta(seconds=min(remaining, _BOOTSTRAP_CHECK)),
                )
            except RendezvousTimeoutError:
                current, _ = self._shared.read()
                if bootstrap_abandoned(state, current):
                    return False
            else:
                return True

    def is_closed(self) -> bool:
        """Tell whether the run is closed.

        Returns:
            True once any node called :meth:`set_closed`.

        Raises:
            RendezvousConnectionError: The backend cannot be reached.
        """
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
        call_within(within, f"closing the run {self._settings.run_id!r}", self._close_run)

    def _close_run(self) -> None:
        def close(state: RendezvousState | None) -> RendezvousState | None:
            return (
                None if state is not None and state.closed else (state or RendezvousState()).close()
            )

        deadline = self._clock() + self._settings.timeout.close.total_seconds()
        written, settled = self._shared.update(close, deadline, self._clock)
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
        :func:`~rdzv.dynamic.pacing.waiting_poll_gap` of its round (0.5 s at
        1,024 members, 0.1 s at 200) and answers from its last reading in
        between, so agents asking every 0.1 s keep one store host's load
        bounded whatever the size (torch serves its state for 1 s).

        Returns:
            The number of waiting nodes (dead or departed members count); for
            a node that is no member, the length of the next round's queue.

        Raises:
            RendezvousConnectionError: The backend cannot be reached, or this
                node's heartbeats failed ``keep_alive_max_attempt`` times.
        """
        self._check_keepalive()
        now = self._clock()
        with self._lock:
            member = self._member_of
            answered = self._waiting_answer
        if member is None:
            state, _ = self._shared.read()
            return self._queue.queue_length(0 if state is None else state.next_round)
        if (
            answered is not None
            and answered[0] is member
            and now - answered[1] < waiting_poll_gap(member.seat.world_size)
        ):
            return answered[2]
        waiting = self._count_waiting(member)
        with self._lock:
            self._waiting_answer = (member, now, waiting)
        return waiting

    def _count_waiting(self, member: _Membership) -> int:
        """Read how many nodes wait beside ``member``'s round (:meth:`num_nodes_waiting`)."""
        changed, state = self._shared.changed_since(member.token)
        if not changed:
            state = state or member.state
            if state is None:
                # Still as sealed with this node's seat: no list to read.
                length = self._queue.queue_length(member.round + 1)
                return nodes_waiting_unchanged(member.seat.world_size, length, self._limits)
        length = self._queue.queue_length(0 if state is None else state.next_round)
        if state is None or round_lost(member.round, state):
            return max(1, length)
        return nodes_waiting(state, length, self._node, self._limits)

    def pre_shutdown(self) -> None:
        """Stop sending heartbeats (the first half of :meth:`shutdown`)."""
        self._stop_keepalive()

    def shutdown(self) -> bool:
        """Leave the run: stop heartbeats and remove this node from its round.

        The run stays open, so the other nodes can re-form without this one.
        It returns within a few seconds whatever the backend does.

        Returns:
            True if the node left cleanly; False if the backend could not be
            reached (the others then detect it by its missing heartbeats).
        """
        self._stop_keepalive()
        self._release_port()
        with self._lock:
            member = self._member_of
            self._member_of = None
        try:
            call_within(_SHUTDOWN_WITHIN, f"node {self._node} leaving", lambda: self._leave(member))
        except (RendezvousConnectionError, RendezvousTimeoutError) as exc:
            LOGGER.warning("rdzv shutdown of %s did not reach the backend: %s", self._node, exc)
            return False
        self._event("shutdown", -1 if member is None else member.round)
        return True

    def _leave(self, member: _Membership | None) -> None:
        if member is not None:
            self._evict([self._node], member.round)
        self._liveness.forget(self._node)

    def close(self) -> None:
        """Stop heartbeats and close the backend and store this handler was given.

        Call it once the handler is done (after :meth:`shutdown` or
        :meth:`set_closed`); the handler, its backend and its store are not
        used after. It does not leave the round: a node that closes without
        ``shutdown`` is found dead by its missing heartbeats.
        """
        self._stop_keepalive()
        self._release_port()
        try:
            self._backend.close()
        finally:
            self._store.close()

    # -- keep-alive ---------------------------------------------------------

    def _leave_round(self) -> None:
        """Leave the round this node is a member of, before joining the next one.

        A member that re-joins a full round would otherwise look like a spare
        to the others, who would never re-form with it. Once any member has
        left or was evicted the others re-form anyway, so one leave is
        enough. Members re-join together (a scale-up, a lost peer), and each
        compare-and-set of the state writes the whole participant list: a
        thousand leaving members raced with a thousand such writes. So each
        first tries to create the round's leave key, holding its node key
        (one compare-and-set of a small key that only creates it, so it never
        retries: an ``add`` would be a retried compare-and-set loop on etcd),
        and only the one that created it writes the state. Should it die
        before writing, the others still re-form once its ring predecessor
        evicts it.
        """
        with self._lock:
            member = self._member_of
            self._member_of = None
        if member is None:
            return
        key = _leave_key(self._prefix, member.round)
        me = self._node.encode()
        if store_call("leave", lambda: self._store.compare_set(key, b"", me)) == me:
            self._evict([self._node], member.round, unless_any_evicted=True)

    def _evict(
        self,
        nodes: Sequence[str],
        round_id: int,
        unless_any_evicted: bool = False,
        via: SharedState | None = None,
    ) -> bool:
        """Remove ``nodes`` from the live members of ``round_id`` with one compare-and-set.

        With ``unless_any_evicted``, do nothing once any member of the round
        is already evicted. ``via`` is the channel to write through (the
        backend's by default).
        """
        evicted: list[str] = []

        def evict(state: RendezvousState | None) -> RendezvousState | None:
            evicted[:] = (
                [] if state is None else leaving_members(state, round_id, nodes, unless_any_evicted)
            )
            return None if state is None or not evicted else state.evict(evicted)

        written, _ = (via or self._shared).update(evict)
        if written is None:
            return False
        self._event("evict", round_id, evicted=list(evicted))
        return True

    def _hold_port(self) -> int:
        """Bind a free port for the bootstrap store (once per join) and return it.

        A host that has no free port (every ephemeral port taken) joins
        without one: if it becomes rank 0, the seal names no port and rank
        0 publishes one after the seal, as an older rdzv's rank 0 does,
        instead of this node failing its join and leaving the others to
        wait for it until their join timeout.
        """
        if self._held_port is None:
            try:
                self._held_port = _bound_socket()
            except OSError as exc:
                self._event("port-failed", -1, error=str(exc))
                return 0
        return int(self._held_port.getsockname()[1])

    def _release_port(self) -> None:
        """Let the held port go, so rank 0's workers can serve on it."""
        held, self._held_port = self._held_port, None
        if held is not None:
            held.close()

    def _start_keepalive(self) -> None:
        self._keepalive.start()

    def _stop_keepalive(self) -> None:
        self._keepalive.stop()

    def _judge_ring(self, seat: Seat) -> None:
        """Make the keep-alive judge ``seat``'s ring from now on.

        Until then a member of an earlier round keeps judging that round's
        ring (a member that died while the others re-joined is found there),
        and its first readings of the new ring do not compete with the
        confirmations: in a recovery of 1,024 nodes the 1,023 survivors'
        keep-alives read the new ring while they confirmed.
        """
        with self._lock:
            self._watched = seat
        self._keepalive.wake()

    def _watched_round(self) -> Seat | None:
        with self._lock:
            return self._watched

    def _evict_dead(self, dead: list[str], seat: Seat) -> None:
        """Evict the ring successor the keep-alive judged dead from ``seat``; watch the next one.

        The next successor comes from the state as stored after the
        eviction (a rare read of the whole list); once the round is gone,
        nobody is watched until this node completes another.
        """
        self._evict(dead, seat.round, via=self._side)
        current, _ = self._side.read()
        following = (
            watching_seat(current, self._node)
            if current is not None and current.round == seat.round
            else None
        )
        with self._lock:
            if self._watched is seat:
                self._watched = following


@dataclass(frozen=True)
class _Membership:
    """The round this node is a member of, as it learned it.

    Attributes:
        seat: This node's seat.
        token: The token of the state this node learned it from: while it
            is stored, the round is as sealed.
        state: That state, when this node read it whole; None when it
            learned its place from its stored seat alone.
    """

    seat: Seat
    token: Token
    state: RendezvousState | None

    @property
    def round(self) -> int:
        """The round."""
        return self.seat.round

    @classmethod
    def of(cls, state: RendezvousState | None, token: Token, node: str) -> _Membership:
        """Return ``node``'s membership of ``state``, which seats it (``Complete`` was decided)."""
        # Complete is decided only on a sealed state that holds this node.
        assert state is not None
        seat = Seat.of(state, node)
        assert seat is not None
        return cls(seat, token, state)


class _EventText:
    """An event's JSON text, built only when a log handler formats the record.

    The handlers that read the event itself (``rdzv run``'s progress, the
    torchrun bridge) never pay for it; a member of thousands logs four
    events per round.
    """

    __slots__ = ("_event",)

    def __init__(self, event: dict[str, Any]) -> None:
        self._event = event

    def __str__(self) -> str:
        return json.dumps(self._event, sort_keys=True)


def _round_key(prefix: str, round_id: int) -> str:
    """The key holding ``round_id`` as sealed, for members that ask for its participants."""
    return f"{prefix}round/{round_id}"


def _bound_socket() -> socket.socket:
    """Return a TCP socket bound to a free port on every interface (not listening)."""
    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        held.bind(("", 0))
    except OSError:
        held.close()
        raise
    return held


def _leave_key(prefix: str, round_id: int) -> str:
    """The key naming the member that left ``round_id`` first (see ``_leave_round``)."""
    return f"{prefix}leave/{round_id}"


def _some_nodes(nodes: Sequence[str], shown: int = 5) -> str:
    """Name the first ``shown`` of ``nodes`` (valid node keys print as they are), and the rest's count."""
    named = ", ".join(nodes[:shown])
    return named + (f" and {len(nodes) - shown} more" if len(nodes) > shown else "")


def create_handler(
    store: Store, backend: RendezvousBackend, params: RendezvousParameters
) -> DynamicRendezvousHandler:
    """Build a :class:`DynamicRendezvousHandler` from rendezvous parameters.

    The settings come from :meth:`RendezvousSettings.from_params
    <rdzv.api.RendezvousSettings.from_params>` (``join_timeout``,
    ``last_call_timeout``, ``close_timeout``, ``heartbeat``,
    ``keep_alive_interval``, ``keep_alive_max_attempt``).

    Args:
        store: The store members get.
        backend: The backend holding the shared state.
        params: The parameters (``run_id``, ``min_nodes``, ``max_nodes``,
            ``local_addr`` (without it, the address facing the endpoint:
            :func:`rdzv.net.advertised_address`), ``node_rank``, config).

    Returns:
        The handler; :meth:`DynamicRendezvousHandler.close` closes ``backend``
        and ``store``.

    Raises:
        ValueError: A parameter is invalid; the message names it.
    """
    return DynamicRendezvousHandler.from_settings(
        RendezvousSettings.from_params(params),
        store,
        backend,
        params.local_addr or advertised_address(params.endpoint),
        node_rank=params.node_rank,
    )
