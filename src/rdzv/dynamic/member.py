"""This node's membership of the run's rounds: which round it is in, evictions, leaving.

Theory of operation
-------------------
A node is a member of at most one round, the last it completed
(:class:`Member`). :class:`Membership` holds that round with what hangs
off it, under one lock shared by the join, the keep-alive and the agent's
calls:

* **the waiting count**: ``num_nodes_waiting`` reads the backend at most
  once per :func:`~rdzv.dynamic.pacing.waiting_poll_gap` of the round and
  answers from its last reading in between;
* **the ring**: the keep-alive evicts the ring successor it judged dead
  (:meth:`Membership.evict_dead`) through the side channel, never behind
  this node's own blocking watch, and learns the next successor;
* **leaving**: a member leaves its round before it joins the next one
  (:meth:`Membership.leave_round`), with one small write for all the
  members that re-join together;
* **garbage**: the queues and keys of the round a seal made droppable are
  deleted once this node completes a round.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from functools import partial

from rdzv.backends.base import JoinQueueBackend, VerdictBackend
from rdzv.backends.kv import store_call
from rdzv.dynamic.machine import (
    Limits,
    droppable_queue,
    leaving_members,
    nodes_waiting,
    nodes_waiting_unchanged,
    round_lost,
)
from rdzv.dynamic.pacing import waiting_poll_gap
from rdzv.dynamic.seat import Member, Seat, watching_seat
from rdzv.dynamic.shared import SharedState
from rdzv.dynamic.state import JoinRecord, RendezvousState, decode_record, decode_state
from rdzv.errors import RendezvousConnectionError, RendezvousStateError
from rdzv.keys import leave_key, round_key
from rdzv.retry import Clock
from rdzv.store.base import Store

__all__ = ["Membership"]

Event = Callable[..., None]


class Membership:
    """This node's membership of the run's rounds (see the module).

    Args:
        node: This node's key.
        store: The store the run's keys are in.
        prefix: The run's key prefix in it.
        shared: The shared state.
        side: The shared state through the backend's side channel.
        queue: The join queues.
        confirms: The confirmation queues.
        verdicts: Their verdicts.
        limits: The settings.
        clock: The clock.
        event: Logs one structured event: ``event(action, round, **fields)``.
    """

    def __init__(
        self,
        node: str,
        store: Store,
        prefix: str,
        shared: SharedState,
        side: SharedState,
        queue: JoinQueueBackend,
        confirms: JoinQueueBackend,
        verdicts: VerdictBackend,
        limits: Limits,
        clock: Clock,
        event: Event,
    ) -> None:
        self._node = node
        self._store = store
        self._prefix = prefix
        self._shared = shared
        self._side = side
        self._queue = queue
        self._confirms = confirms
        self._verdicts = verdicts
        self._limits = limits
        self._clock = clock
        self._event = event
        self._lock = threading.Lock()
        self._member: Member | None = None
        # The round whose queues this node's last seal made droppable.
        self._dropping: int | None = None
        # The last answer of num_nodes_waiting: (member, when, answer).
        self._waiting_answer: tuple[Member, float, int] | None = None

    @property
    def member(self) -> Member | None:
        """The round this node is a member of, or None."""
        with self._lock:
            return self._member

    def become(self, member: Member) -> None:
        """Make this node a member of ``member``'s round."""
        with self._lock:
            self._member = member

    def take(self) -> Member | None:
        """Stop being a member; return the round this node was a member of, or None."""
        with self._lock:
            member, self._member = self._member, None
        return member

    def nodes_waiting(self) -> int:
        """Return how many nodes wait for a new round (``num_nodes_waiting``)."""
        now = self._clock()
        with self._lock:
            member = self._member
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

    def _count_waiting(self, member: Member) -> int:
        """Read how many nodes wait beside ``member``'s round."""
        changed, state = self._shared.changed_since(member.token)
        if not changed:
            state = state or member.state
            if state is None:
                # Still as sealed with this node's seat: no list to read.
                length = self._queue.queue_length(member.round + 1)
                queued = self._queued(member.round + 1, length)
                return nodes_waiting_unchanged(member.seat.world_size, length, self._limits, queued)
        length = self._queue.queue_length(0 if state is None else state.next_round)
        if state is None or round_lost(member.round, state):
            return max(1, length)
        queued = self._queued(state.next_round, length)
        return nodes_waiting(state, length, self._node, self._limits, queued)

    def _queued(self, round_id: int, length: int) -> list[JoinRecord] | None:
        """Read the queued records when only their keys tell whether they fill a segment."""
        if not (length and self._limits.admission.segment_size):
            return None
        return [decode_record(r) for r in self._queue.queue_records(round_id)]

    def leave_round(self) -> None:
        """Leave the round this node is a member of, before joining the next one.

        A member that re-joins a full round would otherwise look like a spare
        to the others, who would never re-form with it. Once any member has
        left or was evicted the others re-form anyway, so one leave is
        enough. Members re-join together (a scale-up, a lost peer), and each
        compare-and-set of the state writes the whole participant list, so
        each first tries to create the round's leave key, holding its node
        key (one compare-and-set of a small key that only creates it, so it
        never retries: an ``add`` would be a retried compare-and-set loop on
        etcd), and only the one that created it writes the state. Should it
        die before writing, the others still re-form once its ring
        predecessor evicts it.
        """
        member = self.take()
        if member is None:
            return
        key = leave_key(self._prefix, member.round)
        me = self._node.encode()
        if store_call("leave", lambda: self._store.compare_set(key, b"", me)) == me:
            self.evict([self._node], member.round, unless_any_evicted=True)

    def leaver(self, round_id: int) -> str | None:
        """Return the member that left ``round_id`` to re-join (its leave key), or None."""
        key = leave_key(self._prefix, round_id)
        found = store_call("leaver", lambda: self._store.try_multi_get([key]))[0]
        return found.decode() if found else None

    def evict(
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

    def evict_dead(self, dead: list[str], seat: Seat) -> Seat | None:
        """Evict the ring successor the keep-alive judged dead from ``seat``; return the next seat.

        The next successor comes from the state as stored after the
        eviction (a rare read of the whole list); None once the round is gone.
        """
        self.evict(dead, seat.round, via=self._side)
        current, _ = self._side.read()
        if current is None or current.round != seat.round:
            return None
        return watching_seat(current, self._node)

    def sealed(self, round_id: int) -> None:
        """Note that this node sealed ``round_id``: an older round's queues may go."""
        self._dropping = droppable_queue(round_id)

    def drop_old_round(self) -> None:
        """Delete the queues and keys of the round this node's last seal made droppable.

        Garbage collection: a store that fails it keeps the garbage, and the
        round goes on (an event says so).
        """
        dropped, self._dropping = self._dropping, None
        if dropped is None:
            return
        try:
            self._queue.drop_queue(dropped)
            self._confirms.drop_queue(dropped)
            self._verdicts.drop_verdict(dropped)
            for key in (leave_key(self._prefix, dropped), round_key(self._prefix, dropped)):
                store_call("drop", partial(self._store.delete_key, key))
        except RendezvousConnectionError as exc:
            self._event("drop-failed", dropped, error=str(exc))

    def participants_of(self, member: Member) -> tuple[str, ...]:
        """Return the node keys of ``member``'s round in rank order, reading the state if needed.

        Raises:
            RendezvousStateError: The store no longer holds that round.
            RendezvousConnectionError: The backend cannot be reached.
        """
        if member.state is not None:
            return member.state.participants
        key = round_key(self._prefix, member.round)
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
