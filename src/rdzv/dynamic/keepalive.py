"""The keep-alive: this node's heartbeat and the judgement of its ring successor.

Theory of operation
-------------------
One task per handler on the process's shared ticker
(:mod:`rdzv.dynamic.ticker`: one thread runs the ticks of every handler on
the same clock, a standby takes over from a tick stuck in a backend call),
started when the node first enqueues. Each tick does two independent
things, and returns when the next is due:

* **beat**: every ``interval`` it bumps this node's heartbeat mark (and
  from the first beat on, the backend is asked to mark this node gone the
  moment its process dies: :meth:`~rdzv.backends.base.LivenessBackend.present`,
  withdrawn by :meth:`KeepAlive.stop`). Only the
  beat's own failures count toward ``max_attempt``; after that many in a row
  the keep-alive stops and records a :class:`~rdzv.errors.RendezvousConnectionError`
  that the handler's calls raise until the node joins again.
* **judge**: once the node is a member (:meth:`KeepAlive.judge_ring` signals it,
  at the round's verdict or when a confirmation slice passes without it),
  it reads the mark of its ring successor (its
  :class:`~rdzv.dynamic.seat.Seat` names it) every ring period
  (:func:`~rdzv.dynamic.pacing.ring_judge_period`), the first reading at a
  random point of the first period so that a round's members do not all
  read at once. It judges the mark on this node's clock
  (:func:`~rdzv.dynamic.judging.judge_marks`), crediting at most one
  ``interval`` between two readings, so a stalled backend or this node's
  own failed or starved reads never count against the successor; a
  successor judged dead is handed to ``on_dead`` (this node's membership
  evicts it), which names the next successor to judge.
  A reading comes no later than the moment the unchanged mark reaches the
  bound, and a seat that carries the mark as the sealer read it
  (:class:`~rdzv.dynamic.seat.SealedMark`) starts the count when this node
  read the seat.

Beats and judgements run under a caller's deadline
(:func:`rdzv.retry.deadline_within`): the beats of one failure streak share
the budget ``interval x max_attempt`` since the last good beat plus
:data:`CALL_GRACE`, so against a backend that stopped answering the
keep-alive gives up within that time instead of the backend's read timeout
per beat, while a beat that is merely slow on a loaded machine still lands;
a judgement may take the dead-node bound (past it, judging is late anyway).
:meth:`KeepAlive.stop` waits at most :data:`STOP_WAIT` for a call in flight.
These deadlines are each handler's own: another handler's slow backend
delays a tick by at most :data:`rdzv.dynamic.ticker.TAKEOVER`, after which
the ticker's standby runs it.

The keep-alive is supervised: an error in judging or evicting, of any kind,
is logged as an event and retried on the next tick; it never ends the
keep-alive, so a node that is alive and connected keeps beating whatever
else fails (and a tick that raised anything else ends its own task only,
never the ticker's thread). A keep-alive that ended (stopped, or gave up)
is started afresh by the next :meth:`KeepAlive.start`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from rdzv.backends.base import LivenessBackend
from rdzv.dynamic.judging import MarkWatch, judge_marks
from rdzv.dynamic.pacing import ring_judge_period
from rdzv.dynamic.seat import Seat
from rdzv.dynamic.ticker import Task, ticker_for
from rdzv.errors import RendezvousConnectionError, RendezvousError
from rdzv.retry import Clock, deadline_within, jitter

__all__ = ["CALL_GRACE", "STOP_WAIT", "KeepAlive"]

CALL_GRACE = 5.0
"""Seconds a heartbeat may take past the dead-node bound (the etcd client's connect timeout)."""

STOP_WAIT = 1.0
"""Seconds :meth:`KeepAlive.stop` waits for a tick in flight to end."""

Event = Callable[..., None]


class KeepAlive:
    """Beats this node's heartbeat and watches its ring successor, as a task of the shared ticker.

    Args:
        node: This node's key.
        liveness: Where heartbeats go.
        interval: Seconds between beats.
        max_attempt: Failed beats in a row after which the keep-alive gives up.
        dead_after: Seconds without a change of a successor's mark after
            which it is dead.
        judge_every: Seconds between readings of the successor's mark.
        clock: The clock; the ticks wait on it.
        on_dead: Evicts the nodes judged dead from the seat they were
            judged from; returns this node's seat to judge next (None: none).
        event: Logs one structured event: ``event(action, round, **fields)``.
    """

    def __init__(
        self,
        node: str,
        liveness: LivenessBackend,
        interval: float,
        max_attempt: int,
        dead_after: float,
        judge_every: float,
        clock: Clock,
        on_dead: Callable[[list[str], Seat], Seat | None],
        event: Event,
    ) -> None:
        self._node = node
        self._liveness = liveness
        self._interval = interval
        self._max_attempt = max_attempt
        self._dead_after = dead_after
        self._judge_every = judge_every
        self._clock = clock
        self._on_dead = on_dead
        self._event = event
        self._lock = threading.Lock()
        self._task: Task | None = None
        self._stop = threading.Event()
        self._error: RendezvousConnectionError | None = None
        # The tick's own state, touched by the tick alone (one runs at a time).
        self._failures = 0
        self._last_ok = 0.0
        self._next_beat = 0.0
        self._judged: tuple[int, dict[str, MarkWatch]] = (-1, {})
        # Shared with judge_ring(), under the lock: this node's seat in the
        # round whose ring is judged (it changes only when the node completes
        # another round, so a member that dies while the others re-join is
        # still found), whether the last tick found nobody to judge, and
        # whether a wake came since the last tick began.
        self._watched: Seat | None = None
        self._idle = False
        self._woken = False

    @property
    def running(self) -> bool:
        """Whether the keep-alive runs (started, and neither stopped nor given up)."""
        task = self._task
        return task is not None and task.active

    def start(self) -> None:
        """Start beating unless the keep-alive runs; one that ended is started afresh.

        Starting afresh forgets why the last one gave up.
        """
        with self._lock:
            if self.running:
                return
            self._error = None
            self._stop = threading.Event()
            now = self._clock()
            self._failures, self._last_ok, self._judged = 0, now, (-1, {})
            # The first beat is due one interval after joining: an observer only
            # starts judging a node when a round completes, and a round that
            # forms within one interval needs no heartbeat traffic at all.
            self._next_beat = now + self._interval
            # A node with no ring to judge has nothing to do before its first
            # beat, or a wake; one still judging its last round goes on at once.
            self._idle, self._woken = self._watched is None, False
            stop = self._stop
            self._task = ticker_for(self._clock).schedule(
                lambda: self._tick(stop), self._next_beat if self._idle else now
            )

    def stop(self) -> None:
        """Stop the keep-alive; wait at most :data:`STOP_WAIT` seconds for a tick in flight.

        A beat or a judgement still in flight then (bounded by the interval)
        may finish after this returns; no other call is made.
        """
        with self._lock:
            task, self._task = self._task, None
            self._stop.set()
        if task is not None:
            task.cancel(STOP_WAIT)
        self._liveness.absent(self._node)

    def judge_ring(self, seat: Seat) -> None:
        """Judge ``seat``'s ring from now on, starting now.

        Called when the round is confirmed, or its confirmation is late (see
        the module). Until then a member of an earlier round keeps judging
        that round's ring (a member that died while the others re-joined is
        found there), and its first readings of the new ring do not compete
        with the confirmations.
        """
        with self._lock:
            self._watched = seat
            self._woken = True
            task = self._task
            if self._idle and task is not None:
                task.wake(self._clock())

    @property
    def watched(self) -> Seat | None:
        """This node's seat in the round whose ring is judged, or None."""
        with self._lock:
            return self._watched

    @property
    def error(self) -> RendezvousConnectionError | None:
        """Why the keep-alive gave up, until it starts again; None if it did not."""
        return self._error

    def check(self) -> None:
        """Raise :attr:`error`, if the keep-alive gave up."""
        error = self._error
        if error is not None:
            raise error

    def _tick(self, stop: threading.Event) -> float | None:
        """Beat if due, judge, and return the reading of the next tick; None once given up."""
        with self._lock:
            spread, self._idle, self._woken = self._idle and self._woken, False, False
        seat = self.watched
        if spread and seat is not None:
            # The first reading of a new ring only sets its baseline: spread
            # over one period, so that the members of a round confirmed at
            # once do not all read at once.
            period = ring_judge_period(self._judge_every, self._interval, seat.world_size)
            now = self._clock()
            return now + min(max(0.0, self._next_beat - now), period * jitter(0.0, 1.0))
        now = self._clock()
        if now >= self._next_beat:
            # The beats of one failure streak share one budget: the
            # dead-node bound since the last good beat, plus a call's grace.
            with deadline_within(self._last_ok + self._dead_after + CALL_GRACE - now, self._clock):
                self._failures = self._beat(self._failures, stop)
            if self._failures == 0:
                self._last_ok = now
            if self._failures >= self._max_attempt:
                return None
            self._next_beat = now + self._interval
        try:
            with deadline_within(self._dead_after, self._clock):
                self._judged = self._judge(self._judged)
        except Exception as exc:  # noqa: BLE001 - supervised: retried on the next tick
            self._event("judge-failed", self._judged[0], error=f"{type(exc).__name__}: {exc}")
        member = self.watched
        if member is None:
            # Nobody to judge (not a member yet): tick only to beat, or when
            # woken. A thousand joining handlers in one process would
            # otherwise tick dozens of times a second each, for nothing.
            with self._lock:
                self._idle = True
                if not self._woken:
                    return self._next_beat
            return self._clock()  # woken while this tick ran: spread at once
        period = ring_judge_period(self._judge_every, self._interval, member.world_size)
        pause = period * jitter(0.75, 1.25)
        watches = self._judged[1] if self._judged[0] == member.round else {}
        watch = None if member.successor is None else watches.get(member.successor)
        if watch is not None:
            # The reading that judges comes as the bound is reached, not up
            # to a period after it. At least a millisecond: a rounding error
            # short of the bound would otherwise be waited for again and again.
            pause = min(pause, max(0.001, self._dead_after - watch.credited))
        return self._clock() + pause

    def _beat(self, failures: int, stop: threading.Event) -> int:
        """Beat once; return the number of failed beats in a row."""
        try:
            self._liveness.beat(self._node)
            # From the first beat on, not at the join: a round that forms
            # within an interval does not wait behind a connection per node.
            if not stop.is_set():
                self._liveness.present(self._node)
        except (RendezvousError, OSError) as exc:
            failures += 1
            self._event("keepalive-failed", -1, attempt=failures, error=str(exc))
            if failures >= self._max_attempt and not stop.is_set():
                with self._lock:
                    self._error = RendezvousConnectionError(
                        f"node {self._node} gave up after {failures} failed keep-alive "
                        f"heartbeats in a row; the backend is unreachable: {exc}"
                    )
            return failures
        return 0

    def _judge(self, judged: tuple[int, dict[str, MarkWatch]]) -> tuple[int, dict[str, MarkWatch]]:
        """Read the ring successor's mark and judge it; return the watches kept.

        The reading counts from when it is sent: the mark read is at least
        as new as then. Stamped at the top of the tick instead, a reading
        that followed a beat slowed by a loaded machine counted that beat's
        time as its own, and judgements came late by as much.
        """
        member = self.watched
        successor = member.successor if member is not None else None
        if member is None or successor is None:
            return judged
        watched_round, watches = judged
        if member.round != watched_round:
            watches = _sealed_watch(member)
        now = self._clock()
        try:
            marks = {successor: self._liveness.heartbeat_mark(successor)}
        except RendezvousConnectionError as exc:
            self._event("watch-failed", member.round, error=str(exc))
            return member.round, watches
        watches, dead = judge_marks(watches, marks, now, self._dead_after, self._interval)
        if dead:
            self._event("dead", member.round, suspects=dead)
            following = self._on_dead(dead, member)
            with self._lock:
                if self._watched is member:
                    self._watched = following
        return member.round, watches


def _sealed_watch(seat: Seat) -> dict[str, MarkWatch]:
    """Return the watch of ``seat``'s successor that its sealed mark gives, if any.

    The sealer read the mark before it wrote the seat, so before this node
    read the seat: the mark has been unchanged at least since then.
    """
    sealed = seat.sealed_mark
    if seat.successor is None or sealed is None or sealed.read_at is None:
        return {}
    return {seat.successor: MarkWatch(sealed.mark, sealed.read_at, 0.0, sealed.read_at)}
