"""One join: a call of ``next_rendezvous`` as an explicit state object, its steps as methods.

Theory of operation
-------------------
:meth:`Join.run` loops: observe what was read, ask
:func:`rdzv.dynamic.machine.decide` for the next action, and apply it with
one step (:meth:`~Join.enqueue`, :meth:`~Join.requeue`, :meth:`~Join.seal`,
:meth:`~Join.wait`, :meth:`~Join.complete`). What the join knows lives in
its fields: the machine's :class:`~rdzv.dynamic.machine.JoinProgress`, the
state (or its summary) and token last read, the queue's length, and, while
a seal is deferred, the nodes it judges and those it judged dead. How long
each wait lasts is :mod:`rdzv.dynamic.pacing`'s; which read serves a wait
is the step's.

On a backend that stores seats (``SeatedBackend``) the join decides on the
state's summary until this node's round is sealed
(:data:`rdzv.dynamic.machine.StateView`), waits for a seal that seats it,
and reads the state itself only to seal or when a round was sealed without
a seat for it (:mod:`rdzv.dynamic.seat`).

A sealed round is completed in three steps: confirm it (no member starts
work beside a node that died in the queue, :mod:`rdzv.dynamic.confirm`),
learn rank 0's address (:mod:`rdzv.dynamic.bootstrap`), and hand out the
round's store. When a member is lost before every member confirmed, or
rank 0 left before publishing, the join starts over on the next round,
within the same join deadline.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import NoReturn

from rdzv.api import RendezvousInfo, RendezvousSettings, RendezvousStoreInfo
from rdzv.backends.base import JoinQueueBackend, LivenessBackend, Token, VerdictBackend
from rdzv.backends.kv import store_call
from rdzv.dynamic.bootstrap import HeldPort, await_bootstrap
from rdzv.dynamic.confirm import RoundConfirmation, check_period, member_lost
from rdzv.dynamic.judging import MarkWatch, SealJudging, judge_marks
from rdzv.dynamic.keepalive import KeepAlive
from rdzv.dynamic.machine import (
    Complete,
    Enqueue,
    Fail,
    FailReason,
    JoinProgress,
    Limits,
    Requeue,
    Seal,
    StateView,
    Wait,
    decide,
    last_call_left,
    missing_members,
    newcomers,
    observe,
    plan_seal,
    start_join,
)
from rdzv.dynamic.member import Membership
from rdzv.dynamic.pacing import queue_wait, state_wait
from rdzv.dynamic.seat import Member
from rdzv.dynamic.shared import SharedState
from rdzv.dynamic.state import (
    JoinRecord,
    RendezvousState,
    StateSummary,
    decode_record,
    decode_state,
    encode_record,
    encode_state,
    node_address,
)
from rdzv.errors import (
    RendezvousClosedError,
    RendezvousExhaustedError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
)
from rdzv.keys import round_key, round_store_prefix
from rdzv.retry import Clock, jitter
from rdzv.store.base import Store, StoreLike
from rdzv.store.memory import PrefixStore

__all__ = ["Join", "JoinContext"]


@dataclass(frozen=True)
class JoinContext:
    """What every join of one handler works with: the node, its settings and the handler's parts.

    Attributes:
        node: This node's key.
        node_rank: The rank it asks for, or -1.
        local_addr: The address published for it.
        settings: The rendezvous settings.
        limits: The settings the machine decides on.
        interval: The heartbeat interval, in seconds.
        clock: The clock of every deadline and wait.
        store: The store members get; also the run's keys.
        prefix: The run's key prefix in ``store``.
        shared: The shared state.
        queue: The join queues.
        confirms: The confirmation queues.
        verdicts: The confirmations' verdicts.
        liveness: Heartbeats.
        members: This node's membership.
        port: The port it holds for the bootstrap store.
        keepalive: Its keep-alive.
        event: Logs one structured event: ``event(action, round, **fields)``.
        caller_store: The round's store as the caller gets it, from its prefix
            (:func:`~rdzv.store.foreign.caller_view`).
        topology: Its value of the rank-order key, published with its join.
    """

    node: str
    node_rank: int
    local_addr: str
    settings: RendezvousSettings
    limits: Limits
    interval: float
    clock: Clock
    store: Store
    prefix: str
    shared: SharedState
    queue: JoinQueueBackend
    confirms: JoinQueueBackend
    verdicts: VerdictBackend
    liveness: LivenessBackend
    members: Membership
    port: HeldPort
    keepalive: KeepAlive
    event: Callable[..., None]
    caller_store: Callable[[str], StoreLike]
    topology: str = ""

    def config(self) -> str:
        """Name the run and its size, for messages."""
        s = self.settings
        return f"run_id={s.run_id} min_nodes={s.min_nodes} max_nodes={s.max_nodes}"


class Join:
    """One call of ``next_rendezvous`` (see the module).

    Attributes:
        progress: What the machine knows of this join.
        state: The state, or its summary, as last read.
        token: Its token.
        queue_length: The length of the round's queue as last read.
        now: The clock's reading the next decision is made at.
        seated: This node's membership, once a stored seat gave it.
        attempt: How many waits for the state came before (sets the
            backoff of backends without watches).
        reported: The queue length last reported in a ``waiting`` event.
        suspects: The nodes a deferred seal judges meanwhile.
        excluded: The nodes it judged dead, which the seal leaves out.
        watches: What it knows of the suspects' heartbeat marks.
        judging: When it judges them next.
    """

    progress: JoinProgress
    state: StateView | None
    token: Token | None
    queue_length: int
    now: float
    seated: Member | None
    suspects: list[str]
    excluded: set[str]
    judging: SealJudging

    def __init__(self, context: JoinContext) -> None:
        self._c = context
        self.attempt = 0
        self.reported = 0
        self.watches: dict[str, MarkWatch] = {}

    def run(self) -> RendezvousInfo:
        """Join the next round and block until it completes (``next_rendezvous``)."""
        self.begin(None)
        c = self._c
        while True:
            self.progress = observe(
                self.progress, self.state, self.queue_length, c.limits, self.now
            )
            action = (
                Complete(self.seated.seat.rank)
                if self.seated is not None
                else decide(
                    self.progress, self.state, self.queue_length, c.node, c.limits, self.now
                )
            )
            match action:
                case Complete():
                    info = self.complete(self._member())
                    if info is not None:
                        return info
                    # A member was lost before every member confirmed, or rank 0
                    # left before publishing its address: join the next round,
                    # still within this call's join deadline.
                    self.begin(self.progress.started_at)
                    continue
                case Fail(reason):
                    self.fail(reason)
                case Enqueue(round_id):
                    self.enqueue(round_id)
                case Requeue(round_id):
                    self.requeue(round_id)
                case Seal() if isinstance(self.state, StateSummary):
                    # The seal needs the participants: decide again on the state.
                    self.state, self.token = c.shared.read()
                    continue
                case Seal(reform):
                    self.seal(reform)
                case Wait():
                    self.wait(action)
            self.now = c.clock()

    def begin(self, started_at: float | None) -> None:
        """Leave this node's round and start joining the next one (``started_at`` is kept)."""
        c = self._c
        c.members.leave_round()
        # Until this node's round is sealed, the state's summary decides as
        # the state would (rdzv.dynamic.machine.StateView).
        self.state, self.token = c.shared.read_view()
        self.now = c.clock()
        progress = start_join(self.state, self.now)
        self.progress = progress if started_at is None else replace(progress, started_at=started_at)
        self.queue_length, self.suspects, self.judging, self.excluded = 0, [], SealJudging(), set()
        self.seated = None
        # A member that left the last round to re-join, which the seal waits for.
        self.leaver: str | None = None
        c.event("join", self.progress.round_id)

    def _member(self) -> Member:
        if self.seated is not None:
            return self.seated
        # decide() completes on a state, never on a summary.
        assert isinstance(self.state, RendezvousState)
        return Member.of(self.state, self.token, self._c.node)

    def enqueue(self, round_id: int) -> None:
        """Enqueue this node's record for ``round_id`` and start its heartbeats."""
        c = self._c
        record = encode_record(JoinRecord(c.node, c.node_rank, c.port.hold(), c.topology))
        position = c.queue.enqueue(round_id, record)
        self.progress = replace(self.progress, position=position)
        self.queue_length = max(self.queue_length, position)
        c.keepalive.start()
        c.event("enqueue", round_id, position=position)

    def requeue(self, round_id: int) -> None:
        """Join ``round_id`` instead: the round joined was sealed without this node, or is gone."""
        self._c.event("requeue", round_id, missed=self.progress.round_id)
        self.progress = JoinProgress(round_id, self.progress.started_at)
        self.queue_length, self.judging, self.excluded = 0, SealJudging(), set()

    def wait(self, action: Wait) -> None:
        """Wait for the state (or, for a deferred seal, the queue) until ``action``'s deadline."""
        c = self._c
        remaining = max(0.0, action.deadline - self.now)
        round_id = self.progress.round_id
        if action.on_queue:
            self.queue_length = c.queue.wait_queue_length(
                round_id, self.queue_length, queue_wait(remaining)
            )
            if self.suspects:
                due, self.judging = self.judging.due(
                    self.progress.position, c.limits, c.clock(), c.interval
                )
                if due:
                    self._judge_suspects()
            self.state, self.token = c.shared.read()
        else:
            self.state, self.token, self.seated = c.shared.wait(
                c.node,
                self.state,
                self.token,
                round_id,
                state_wait(remaining, self.queue_length, jitter(1.0, 1.5)),
                self.attempt,
                max(0.0, self.progress.deadline(c.limits) - self.now),
            )
            self.attempt += 1
            if self.seated is None and (self.state is None or self.state.round < round_id):
                # A sealed round decides without the queue: one request
                # fewer for each of its members.
                self.queue_length = c.queue.queue_length(round_id)
        if self.queue_length != self.reported:
            # Progress for whoever waits with this node (rdzv run prints it).
            self.reported = self.queue_length
            now = c.clock()
            left = last_call_left(self.progress, self.state, self.queue_length, c.limits, now)
            c.event(
                "waiting",
                round_id,
                joined=self.queue_length,
                min_nodes=c.limits.min_nodes,
                max_nodes=c.limits.max_nodes,
                **_target(c.limits),
                timeout_in=round(self.progress.deadline(c.limits) - now, 3),
                last_call_in=None if left is None else round(left, 3),
            )

    def _judge_suspects(self) -> None:
        """Judge the nodes a deferred seal waits for or would admit.

        The dead members of the last round are evicted; every node judged
        dead is added to ``excluded``, which the seal leaves out: a node that
        died in the queue while the seal waited is in no round sealed later.
        """
        c = self._c
        # A seal deferred on the state it read: not a summary.
        state = self.state
        assert not isinstance(state, StateSummary)
        marks = c.liveness.heartbeat_marks(self.suspects)
        self.watches, dead = judge_marks(self.watches, marks, c.clock(), c.limits.grace, c.interval)
        if dead:
            round_id = state.round if state is not None else -1
            c.event("dead", round_id, suspects=dead)
            self.excluded.update(dead)
            if self.leaver in dead:
                # Not a live member: no eviction re-opens the seal, so retry it now.
                self.progress = replace(self.progress, blocked=None)
            if state is not None and set(dead) & set(state.live_participants()):
                c.members.evict(dead, state.round)

    def seal(self, reform: bool = False) -> None:
        """Seal the round, or defer it and judge meanwhile the nodes it waits for.

        Those are the members of the last round that have not re-joined, and
        the other queued nodes: one that dies in the queue while the seal
        waits is judged and left out (``excluded``). A re-formation sealing
        without a last call (``reform``) that finds a newcomer in the queue
        does not seal: the round waits its last call.
        """
        c = self._c
        state = self.state
        assert not isinstance(state, StateSummary)
        round_id = self.progress.round_id
        records = [
            r
            for r in (decode_record(r) for r in c.queue.queue_records(round_id))
            if r.node not in self.excluded
        ]
        if reform and newcomers(state, records):
            self.progress = replace(self.progress, newcomers=True)
            c.event("last-call", round_id, queued=len(records), seconds=c.limits.last_call)
            return
        self.leaver = None
        if not c.limits.admission.default and state is not None and state.round >= 0:
            leaver = c.members.leaver(state.round)
            self.leaver = None if leaver in self.excluded else leaver
        plan = plan_seal(state, round_id, records, c.limits, self.leaver)
        if plan is None:
            missing = missing_members(state, records, self.leaver)
            c.event("seal-deferred", round_id, queued=len(records), missing=len(missing))
            queued = [r.node for r in records if r.node != c.node and r.node not in missing]
            self.progress = replace(self.progress, blocked=(self.queue_length, state))
            self.suspects = missing + list(dict.fromkeys(queued))
            return
        self.suspects = []
        # The seats let each member learn its place without the participant
        # list, on a backend that stores them; a seal that does not know rank
        # 0's port stores none (every member then reads the state and waits
        # for rank 0's address).
        seats = c.shared.seats(plan, self._sealed_marks) if plan.bootstrap_port else None
        encoded = encode_state(plan)
        result = c.shared.write(plan, encoded, self.token, seats)
        if result is None:
            self.state, self.token = None, None
            return
        new_state, self.token, written = result
        if not written:
            self.state = decode_state(new_state)
            return
        self.state = plan
        c.event("sealed", round_id, world_size=len(plan.participants))
        if seats:
            # The round's list for members that ask (RendezvousInfo.participants),
            # kept as long as its join queue: written before this node
            # confirms, so before any member completes.
            key = round_key(c.prefix, round_id)
            store_call("seal", lambda: c.store.set(key, encoded))
        # Dropped once this node confirmed (complete): requests with a
        # reply sent now would queue behind every member's confirmation,
        # and the round's verdict waits for this node's too.
        c.members.sealed(round_id)

    def _sealed_marks(self, plan: RendezvousState) -> dict[str, bytes | None] | None:
        """Read the marks of ``plan``'s members for their seats (:class:`~rdzv.dynamic.seat.SealedMark`).

        One read; a failed one leaves the seats without marks (the members
        then judge from their own first readings, as before). The marks only
        make judgements sooner, so no failure of this read, of any kind (a
        third-party backend's bug too), stops the seal.
        """
        try:
            return self._c.liveness.heartbeat_marks(plan.live_participants())
        except Exception as exc:  # noqa: BLE001 - best effort: the seal goes on without marks
            self._c.event("marks-failed", plan.round, error=f"{type(exc).__name__}: {exc}")
            return None

    def fail(self, reason: FailReason) -> NoReturn:
        """End the join without a round, for ``reason``."""
        c = self._c
        round_id = self.progress.round_id
        c.event("fail", round_id, reason=reason.value)
        if reason is FailReason.CLOSED:
            raise RendezvousClosedError(f"the rendezvous {c.settings.run_id!r} is closed")
        if reason is FailReason.GRACEFUL_EXIT:
            raise RendezvousGracefulExitError(
                f"node {c.node} is a spare of the closed run {c.settings.run_id!r}"
            )
        join = c.limits.join_timeout
        if reason is FailReason.EXHAUSTED:
            raise RendezvousExhaustedError(c.config(), join)
        raise RendezvousTimeoutError(
            f"round {round_id} of {c.config()} did not complete within the "
            f"join timeout of {join:g} s"
        )

    def complete(self, member: Member) -> RendezvousInfo | None:
        """Become a member of the sealed round; None if it broke before it completed.

        It breaks when a member is lost before every member confirmed, or
        rank 0 left before publishing its address.
        """
        c = self._c
        seat = member.seat
        join_deadline = self.progress.deadline(c.limits)
        # A node whose heartbeats gave up is as good as dead to the others:
        # it joins no round (nor completes one it confirmed meanwhile, below).
        c.keepalive.check()
        c.members.become(member)
        round_prefix = round_store_prefix(c.settings.run_id, seat.round)
        store = PrefixStore(round_prefix, c.store)
        c.port.release()
        confirmed = seat.world_size == 1 or self._confirm(member, join_deadline)
        # The ring judging starts at the verdict, or at the confirmation's
        # first late slice (see _confirm), whichever comes first.
        c.keepalive.judge_ring(seat)
        c.members.drop_old_round()
        if not confirmed:
            c.event("broken", seat.round, rank=seat.rank, reason="a member was lost")
            return None
        c.keepalive.check()
        bootstrap: RendezvousStoreInfo | None = None
        if seat.port:
            bootstrap = RendezvousStoreInfo(node_address(seat.master), seat.port)
        elif seat.rank != 0:
            # Only a state read whole lacks the port: stored seats name it.
            assert member.state is not None
            if not await_bootstrap(
                store, c.shared, member.state, seat.rank, c.clock, join_deadline
            ):
                c.event(
                    "broken", seat.round, rank=seat.rank, reason="rank 0 left before publishing"
                )
                return None
        c.event("complete", seat.round, rank=seat.rank, world_size=seat.world_size)
        if bootstrap is None or seat.rank == 0:
            bootstrap = RendezvousStoreInfo.build(
                seat.rank,
                store,
                local_addr=bootstrap.master_addr if bootstrap else c.local_addr,
                server_port=bootstrap.master_port if bootstrap else None,
            )
        return RendezvousInfo(
            c.caller_store(round_prefix),
            seat.rank,
            seat.world_size,
            bootstrap,
            # Both read on first use: a member of thousands learns its place
            # from its seat, and reads lists only when asked.
            lambda: [node_address(n) for n in c.members.participants_of(member)],
            lambda: [
                node_address(decode_record(r).node) for r in c.queue.queue_records(seat.round + 1)
            ],
        )

    def _confirm(self, member: Member, join_deadline: float) -> bool:
        """Confirm the sealed round (:mod:`rdzv.dynamic.confirm`); False once a member is lost.

        Raises:
            RendezvousTimeoutError: Not every member confirmed by the join
                deadline, and none was evicted.
        """
        c = self._c
        seat = member.seat
        confirmation = RoundConfirmation(
            c.confirms,
            c.verdicts,
            seat.round,
            seat.world_size,
            lambda: c.members.participants_of(member),
        )
        confirmation.confirm(c.node)
        wait = check_period(seat.world_size, c.limits.grace)
        ring_judging = False
        token = member.token
        while (outcome := confirmation.wait(wait, c.clock, token)) is not True:
            if not ring_judging:
                # No verdict within a slice: a member may have died in the
                # queue, and its ring predecessor must judge it. Until now
                # the ring's first readings would only have competed with
                # the confirmations of a large round.
                c.keepalive.judge_ring(seat)
                ring_judging = True
            if outcome is False:
                # The state was written: read it.
                current, token = c.shared.read()
                if member_lost(seat.round, seat.world_size, current):
                    return False
            left = join_deadline - c.clock()
            if left <= 0:
                missing = confirmation.unconfirmed()
                size = seat.world_size
                raise RendezvousTimeoutError(
                    f"round {seat.round} of {c.config()}: {size - len(missing)} of {size} "
                    f"members confirmed it within the join timeout of "
                    f"{c.limits.join_timeout:g} s; not confirmed: " + _some_nodes(missing)
                )
            # Once the ring judges, the wait needs no slices: it ends at the
            # verdict or a write of the state, and a lost member is evicted
            # by a write.
            wait = left
        return True


def _some_nodes(nodes: Sequence[str], shown: int = 5) -> str:
    """Name the first ``shown`` of ``nodes`` (valid node keys print as they are), and the rest's count."""
    named = ", ".join(nodes[:shown])
    return named + (f" and {len(nodes) - shown} more" if len(nodes) > shown else "")


def _target(limits: Limits) -> dict[str, int]:
    """The ``target_nodes`` field of a ``waiting`` event: only when a target is set."""
    target = limits.admission.target_nodes
    return {} if target is None else {"target_nodes": target}
