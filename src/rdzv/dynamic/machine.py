"""The sans-I/O rendezvous state machine: pure decisions, no I/O, no clock.

Theory of operation
-------------------
The shared state (``RendezvousState``) names the last *sealed* round ``r``
and its participants. A node that wants to join enqueues ONE record in the
join queue of round ``r + 1`` (a non-conflicting write; see
``JoinQueueBackend``) and learns its 1-based *position*. While round ``r``
runs, that queue is the wait list.

Who seals round ``r + 1`` (a single compare-and-set of the state that
publishes participants and ranks)?

* the node at position ``max_nodes`` (or ``target_nodes``:
  :attr:`Limits.seal_at`), at once: the round is full;
* the node at position ``min_nodes`` (the *last-call leader*), when the
  last call expires on ITS monotonic clock, counted from its own arrival;
  a *re-formation* (the last round had live members, and the queue is at
  least as long as their number) needs no last call: the leader seals at
  once if every queued node was a member of the last round (nobody new is
  arriving, and nobody else is coming: a member that is not queued is dead
  or about to re-join, and the seal waits for it anyway, below); a queue
  with a newcomer in it waits the last call as a first formation does
  (:attr:`Seal.reform`, :func:`newcomers`);
* any other admitted node, as a backup, later than the leader would have
  (the leader may have died): ``grace`` later for the next position, and one
  more ``grace`` for each doubling of its distance from the leader
  (:func:`backup_delay`), so that when a leader is slow the backups do not
  all read the queue and race to seal at once; at most twice as many act in each tier as
  in the one before;
* a node beyond ``max_nodes`` (a spare) only when the admitted nodes all
  seem dead: ``last_call + 2 x grace`` after it saw the round full, later
  spares tiered like backups (the plan
  is the same whoever seals: the first ``max_nodes`` records); it then
  enqueues for the next round, where it is on the redundancy list.

Exclusivity: round ``r + 1`` is sealed only when every live participant of
round ``r`` has enqueued for it (so two groups never run at once); members
re-join when :func:`nodes_waiting` says someone waits, and a dead member is
evicted from round ``r`` by a compare-and-set that also makes survivors
re-join. Death is judged by :func:`~rdzv.dynamic.judging.judge_marks` on the observer's own
monotonic clock: a member watches its ring successor (:func:`successor_of`),
and a node whose seal waits for members that have not re-joined
(:func:`missing_members`) watches those (the last-call leaders at once,
everyone else once the seal has stalled, in tiers: :class:`~rdzv.dynamic.judging.SealJudging`),
so a round whose members all died does not block the next one; it watches
the other queued nodes too and leaves those it judged dead out of the seal it
writes. This module decides; ``rdzv.dynamic.handler`` acts.

A store restarted empty (or restored from an older copy) makes the state go
back: a joiner whose round is ahead of the stored one re-joins the stored
round instead of waiting on a queue that no longer exists, and members
re-join too, so the run starts over instead of stranding anyone until the
join timeout. Rounds are then counted anew; exclusivity holds per store
lifetime.

Every function here is pure: inputs are the state, what this node knows of
its join (:class:`JoinProgress`), an observation of the queue, the
settings and ``now`` from an injected monotonic clock. How long each wait
lasts is :mod:`rdzv.dynamic.pacing`'s.

"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from rdzv.dynamic.admission import Admission, admit, grows
from rdzv.dynamic.state import JoinRecord, RendezvousState, StateSummary

__all__ = [
    "Action",
    "Complete",
    "Enqueue",
    "Fail",
    "FailReason",
    "JoinProgress",
    "Limits",
    "Requeue",
    "Seal",
    "Wait",
    "backup_delay",
    "decide",
    "last_call_left",
    "missing_members",
    "newcomers",
    "nodes_waiting",
    "nodes_waiting_unchanged",
    "observe",
    "plan_seal",
    "reforming",
    "start_join",
    "successor_of",
]

StateView = RendezvousState | StateSummary
"""What a join decides on: the state, or its summary while the round it
joins is not sealed (a summary names no participant, so it cannot say
whether this node is a member of a sealed round)."""


@dataclass(frozen=True)
class Limits:
    """The settings the decisions depend on, in seconds.

    Attributes:
        min_nodes: The fewest nodes a round needs.
        max_nodes: The most nodes a round admits.
        join_timeout: How long a join may take.
        last_call: How long to wait for more nodes once ``min_nodes`` joined.
        grace: How much later than a leader a backup acts (the dead-node
            timeout).
        admission: The admission rules (:mod:`rdzv.dynamic.admission`); the
            node counts above are already within its bounds.
    """

    min_nodes: int
    max_nodes: int
    join_timeout: float
    last_call: float
    grace: float
    admission: Admission = field(default_factory=Admission)

    @property
    def seal_at(self) -> int:
        """How many joined nodes seal a round at once: the target, else ``max_nodes``."""
        return self.admission.target_nodes or self.max_nodes


@dataclass(frozen=True)
class JoinProgress:
    """What one node knows about its own join; immutable.

    Attributes:
        round_id: The round it joins.
        started_at: When the join began (monotonic).
        position: Its position in the round's queue, None before enqueueing.
        min_seen_at: When it first saw ``min_nodes`` records, if it did.
        max_seen_at: When it first saw :attr:`Limits.seal_at` records, if it did.
        blocked: ``(queue length, state)`` at which a seal was refused because
            members of the previous round had not re-joined yet.
        newcomers: A seal without a last call found a node in the queue that
            was no member of the last round: this round waits the last call.
    """

    round_id: int
    started_at: float
    position: int | None = None
    min_seen_at: float | None = None
    max_seen_at: float | None = None
    blocked: tuple[int, RendezvousState | None] | None = None
    newcomers: bool = False

    def deadline(self, limits: Limits) -> float:
        """Return when the join times out: ``join_timeout`` after it began."""
        return self.started_at + limits.join_timeout


class FailReason(enum.Enum):
    """Why a join ends without a round."""

    CLOSED = "closed"
    GRACEFUL_EXIT = "graceful-exit"
    EXHAUSTED = "exhausted"
    TIMEOUT = "timeout"


@dataclass(frozen=True)
class Enqueue:
    """Enqueue this node's record for ``round_id``."""

    round_id: int


@dataclass(frozen=True)
class Requeue:
    """The round was sealed without this node: join ``round_id`` instead."""

    round_id: int


@dataclass(frozen=True)
class Seal:
    """Read the queue, plan the participants and compare-and-set the state.

    Attributes:
        reform: A re-formation sealing before its last call expired: seal
            only if every queued node was a member of the last round.
    """

    reform: bool = False


@dataclass(frozen=True)
class Wait:
    """Block until ``deadline`` or until something changes.

    Attributes:
        deadline: Monotonic time to wake up at, at the latest.
        on_queue: Wake on queue changes too (a refused seal waits for
            previous members to re-join), not only on state changes.
    """

    deadline: float
    on_queue: bool = False


@dataclass(frozen=True)
class Complete:
    """This node is a participant of the sealed round, at ``rank``."""

    rank: int


@dataclass(frozen=True)
class Fail:
    """The join ends without a round, for ``reason``."""

    reason: FailReason


Action = Enqueue | Requeue | Seal | Wait | Complete | Fail


def start_join(state: StateView | None, now: float) -> JoinProgress:
    """Begin a join of the round after the last sealed one, against the state as read now."""
    return JoinProgress(round_id=0 if state is None else state.next_round, started_at=now)


def observe(
    progress: JoinProgress, state: StateView | None, queue_length: int, limits: Limits, now: float
) -> JoinProgress:
    """Record what the state and the queue length tell this node.

    A node waiting behind a full round (one its queue cannot make larger:
    :func:`~rdzv.dynamic.admission.grows`) is on the redundancy list: it may
    wait indefinitely, so its join clock restarts while the round stays full.
    Returns the same object when nothing changed.
    """
    if (
        state is not None
        and state.next_round == progress.round_id
        and state.live_count > 0
        and not _room(state.live_count, queue_length, None, limits)
        and progress.started_at != now
    ):
        progress = replace(progress, started_at=now)
    if progress.min_seen_at is None and queue_length >= limits.min_nodes:
        progress = replace(progress, min_seen_at=now)
    if progress.max_seen_at is None and queue_length >= limits.seal_at:
        progress = replace(progress, max_seen_at=now)
    return progress


def _is_spare_in(
    state: StateView | None, progress: JoinProgress, queue_length: int, limits: Limits
) -> bool:
    if progress.position is not None and progress.position > limits.max_nodes:
        return True
    return (
        state is not None
        and state.live_count > 0
        and not _room(state.live_count, queue_length, None, limits)
    )


def decide(
    progress: JoinProgress,
    state: StateView | None,
    queue_length: int,
    node: str,
    limits: Limits,
    now: float,
) -> Action:
    """Decide what a joining node does next, from its progress after :func:`observe`.

    Raises:
        ValueError: ``state`` is the summary of the round this node joins
            (the caller reads the state itself then).
    """
    rank = None
    if state is not None and state.round == progress.round_id:
        if not isinstance(state, RendezvousState):
            raise ValueError(
                f"the summary of sealed round {state.round} cannot tell whether this node is in it"
            )
        rank = state.rank_of(node)
    if rank is not None:
        # Sealed with this node in it: a close that came after the seal (a
        # faster member finished and closed the run before this node read
        # the state) ends the run for later joiners, not for this round.
        return Complete(rank)
    if state is not None and state.closed:
        spare = progress.position is not None and _is_spare_in(
            state, progress, queue_length, limits
        )
        return Fail(FailReason.GRACEFUL_EXIT if spare else FailReason.CLOSED)
    if state is not None and state.round >= progress.round_id:
        return Requeue(state.next_round)
    next_round = 0 if state is None else state.next_round
    if next_round < progress.round_id:
        # The state went back: the store was wiped or restored from an older
        # copy, and the queue this node joined is gone. Join the store's round.
        return Requeue(next_round)
    if progress.position is None:
        return Enqueue(progress.round_id)
    join_deadline = progress.deadline(limits)
    if now >= join_deadline:
        exhausted = queue_length < limits.min_nodes
        return Fail(FailReason.EXHAUSTED if exhausted else FailReason.TIMEOUT)
    if progress.blocked is not None and progress.blocked == (queue_length, state):
        return Wait(join_deadline, on_queue=True)
    if progress.position > limits.max_nodes:
        # A spare: the admitted nodes seal. If they all died the round would
        # never seal, so a spare seals too once they had twice a backup's
        # grace: the same plan (the first max_nodes records), after which
        # the spare re-joins at the front of the next queue and the dead
        # participants are judged like any dead member.
        if progress.max_seen_at is None:
            return Wait(join_deadline)
        stalled = (
            progress.max_seen_at
            + limits.last_call
            + limits.grace
            + backup_delay(progress.position, limits.max_nodes, limits.grace)
        )
        return Seal() if now >= stalled else Wait(min(stalled, join_deadline))
    if queue_length >= limits.seal_at and progress.max_seen_at is not None:
        if progress.position == limits.seal_at:
            return Seal()
        backup = progress.max_seen_at + backup_delay(
            progress.position, limits.seal_at, limits.grace
        )
        return Seal() if now >= backup else Wait(min(backup, join_deadline))
    if queue_length >= limits.min_nodes and progress.min_seen_at is not None:
        backup = progress.min_seen_at + backup_delay(
            progress.position, limits.min_nodes, limits.grace
        )
        expiry = backup + limits.last_call
        if now >= expiry:
            return Seal()
        if reforming(progress, state, queue_length):
            return Seal(reform=True) if now >= backup else Wait(min(backup, join_deadline))
        return Wait(min(expiry, join_deadline))
    return Wait(join_deadline)


def reforming(progress: JoinProgress, state: StateView | None, queue_length: int) -> bool:
    """Tell whether a round may seal without a last call: a re-formation.

    The last round had live members and the queue is at least as long as
    their number (they may all have re-joined), and no seal found a newcomer
    in the queue yet. Called once the state is the round before this one.
    """
    if state is None or progress.newcomers:
        return False
    return 0 < state.live_count <= queue_length


def last_call_left(
    progress: JoinProgress, state: StateView | None, queue_length: int, limits: Limits, now: float
) -> float | None:
    """Return the seconds left of the last call this node runs or sees, or None outside one.

    A last call runs while at least ``min_nodes`` and fewer than
    :attr:`Limits.seal_at` joined, from when this node first saw
    ``min_nodes`` (now, when it sees them only now); a re-formation
    (:func:`reforming`) has none.
    """
    if not limits.min_nodes <= queue_length < limits.seal_at:
        return None
    if reforming(progress, state, queue_length):
        return None
    began = now if progress.min_seen_at is None else progress.min_seen_at
    return began + limits.last_call - now


def newcomers(state: RendezvousState | None, records: Sequence[JoinRecord]) -> bool:
    """Tell whether ``records`` hold a node that was no participant of the last round."""
    previous = set() if state is None else set(state.participants)
    return any(r.node not in previous for r in records)


def backup_delay(position: int, leader: int, grace: float) -> float:
    """Return how much later than the leader the node at ``position`` acts in its place.

    The leader itself: 0. Others: ``grace`` times the number of binary
    digits of their distance from the leader, so one node backs up the
    leader after ``grace``, two more after ``2 x grace``, four more after
    ``3 x grace``, and so on.
    """
    return grace * abs(position - leader).bit_length()


def plan_seal(
    state: RendezvousState | None,
    round_id: int,
    records: Sequence[JoinRecord],
    limits: Limits,
    leaver: str | None = None,
) -> RendezvousState | None:
    """Plan the state that seals ``round_id`` from its join ``records``, in queue order.

    None when the round may not be sealed yet: fewer than ``min_nodes``
    distinct nodes (or than the admission rules can form a round of), or a
    live member of the previous round has not re-joined (nor ``leaver``: see
    :func:`missing_members`).
    """
    if missing_members(state, records, leaver):
        return None
    # Evicted members that re-join (a member leaves before it re-joins) keep
    # their place among the survivors too.
    previous = state.participants if state is not None else ()
    participants = admit(records, previous, limits.min_nodes, limits.max_nodes, limits.admission)
    if len(participants) < limits.min_nodes:
        return None
    # Rank 0's record (its first, should it have enqueued twice) names the
    # port it holds, so the seal publishes the bootstrap address.
    port = next((r.port for r in records if r.node == participants[0]), 0)
    return RendezvousState(round_id, participants, bootstrap_port=port)


def nodes_waiting(
    state: RendezvousState | None,
    next_queue_length: int,
    node: str,
    limits: Limits,
    queued: Sequence[JoinRecord] | None = None,
) -> int:
    """Tell a member how many nodes wait for the next round (its queue is ``next_queue_length``).

    A positive number when the member should re-join: nodes wait and the
    round has room (and, under admission rules, they would make it larger:
    :func:`~rdzv.dynamic.admission.grows`, from the ``queued`` records when
    read), a member was evicted, or a newer round exists. Spares waiting for
    a full round do not count.
    """
    if state is None:
        return next_queue_length
    if state.rank_of(node) is None:
        return max(1, next_queue_length)
    live = state.live_count
    evicted = len(state.participants) - live
    waiting = next_queue_length if _room(live, next_queue_length, queued, limits) else 0
    return waiting + evicted


def nodes_waiting_unchanged(
    world_size: int,
    next_queue_length: int,
    limits: Limits,
    queued: Sequence[JoinRecord] | None = None,
) -> int:
    """Tell a member how many nodes wait, when the state is still as sealed.

    As :func:`nodes_waiting` for the sealed state itself: nobody was
    evicted, so only queued nodes count, when the round has room.
    """
    return next_queue_length if _room(world_size, next_queue_length, queued, limits) else 0


def _room(live: int, queued: int, records: Sequence[JoinRecord] | None, limits: Limits) -> bool:
    """Tell whether ``queued`` nodes would make a round of ``live`` members larger."""
    return live < limits.max_nodes and grows(
        live, queued, records, limits.min_nodes, limits.max_nodes, limits.admission
    )


def round_lost(member_round: int, stored: RendezvousState | None) -> bool:
    """Tell whether the round a member completed is gone from the store.

    It is gone when nothing is stored (the store was wiped), or the stored
    round is another one: an older one (the store went back) or a newer one
    this member never joined (forged, or written by a writer that lost
    track); a newer legitimate round always waits for its live members.
    """
    return stored is None or stored.round != member_round


def bootstrap_abandoned(sealed: RendezvousState, stored: RendezvousState | None) -> bool:
    """Tell whether rank 0 of ``sealed`` can no longer publish its bootstrap address.

    True when the round is gone or closed, or its rank 0 is no live member.
    """
    if stored is None or stored.round != sealed.round or stored.closed:
        return True
    return stored.rank_of(sealed.participants[0]) is None


def droppable_queue(sealed_round: int) -> int | None:
    """Return the round whose join queue may be deleted once ``sealed_round`` sealed, or None.

    The queue of the round before stays: late readers of it (nodes that
    enqueued as the seal landed) re-read it to find they missed the round.
    """
    return sealed_round - 2 if sealed_round >= 2 else None


def leaving_members(
    state: RendezvousState, round_id: int, nodes: Sequence[str], unless_any_evicted: bool
) -> list[str]:
    """Return which of ``nodes`` a compare-and-set must evict from ``round_id``.

    The live members among ``nodes``; empty when no write is needed, which
    with ``unless_any_evicted`` is also once any member is already evicted (a
    member re-joining: the others re-form anyway).
    """
    if state.round != round_id or state.closed:
        return []
    if unless_any_evicted and state.live_count < len(state.participants):
        return []
    return [n for n in nodes if state.rank_of(n) is not None]


def successor_of(state: RendezvousState, node: str) -> str | None:
    """Return the live participant after ``node`` in rank order, wrapping around.

    None when ``node`` is not a live member or is alone.
    """
    live = state.live_participants()
    if node not in live or len(live) < 2:
        return None
    return live[(live.index(node) + 1) % len(live)]


def missing_members(
    state: RendezvousState | None, records: Sequence[JoinRecord], leaver: str | None = None
) -> list[str]:
    """Return the live members of the last round that have not re-joined, in rank order.

    ``leaver``, a member that left the round to re-join (evicted by its own
    leave, so alive), counts as missing too until it re-joined: under
    admission rules a seal waits for it rather than give its place to a spare.
    """
    if state is None:
        return []
    joined = {r.node for r in records}
    missing = [n for n in state.live_participants() if n not in joined]
    if leaver in state.participants and leaver not in joined and leaver not in missing:
        missing.append(leaver)
    return missing
