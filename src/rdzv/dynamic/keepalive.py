"""The keep-alive: this node's heartbeat and the judgement of its ring successor.

Theory of operation
-------------------
One daemon thread per handler, started when the node first enqueues. Each
tick it does two independent things:

* **beat**: every ``interval`` it bumps this node's heartbeat mark. Only the
  beat's own failures count toward ``max_attempt``; after that many in a row
  the thread stops and records a :class:`~rdzv.errors.RendezvousConnectionError`
  that the handler's calls raise until the node joins again.
* **judge**: once the node is a member (:meth:`KeepAlive.wake` signals it,
  at the round's verdict or when a confirmation slice passes without it),
  it reads the mark of its ring successor (its
  :class:`~rdzv.dynamic.seat.Seat` names it) every ring period
  (:func:`~rdzv.dynamic.pacing.ring_judge_period`), the first reading at a
  random point of the first period so that a round's members do not all
  read at once. It judges the mark on this node's clock
  (:func:`~rdzv.dynamic.machine.judge_marks`), crediting at most one
  ``interval`` between two readings, so a stalled backend or this node's
  own failed or starved reads never count against the successor; a
  successor judged dead is handed to ``on_dead`` (the handler evicts it).
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

The thread is supervised: an error in judging or evicting, of any kind, is
logged as an event and retried on the next tick; it never ends the thread,
so a node that is alive and connected keeps beating whatever else fails. A
thread that ended (stopped, or gave up) is started afresh by the next
:meth:`KeepAlive.start`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from rdzv.backends.base import LivenessBackend
from rdzv.dynamic.machine import MarkWatch, judge_marks
from rdzv.dynamic.pacing import ring_judge_period
from rdzv.dynamic.seat import Seat
from rdzv.errors import RendezvousConnectionError, RendezvousError
from rdzv.retry import Clock, deadline_within, jitter
from rdzv.threads import start_thread

__all__ = ["CALL_GRACE", "STOP_WAIT", "KeepAlive"]

CALL_GRACE = 5.0
"""Seconds a heartbeat may take past the dead-node bound (the etcd client's connect timeout)."""

STOP_WAIT = 1.0
"""Seconds :meth:`KeepAlive.stop` waits for the thread to end."""

Event = Callable[..., None]


class KeepAlive:
    """Beats this node's heartbeat and watches its ring successor, in one supervised thread.

    Args:
        node: This node's key.
        liveness: Where heartbeats go.
        interval: Seconds between beats.
        max_attempt: Failed beats in a row after which the keep-alive gives up.
        dead_after: Seconds without a change of a successor's mark after
            which it is dead.
        judge_every: Seconds between readings of the successor's mark.
        clock: The clock; the ticks wait on it.
        watched: Returns this node's seat in the round whose ring is
            watched (its successor there is the node judged), or None.
        on_dead: Called with the nodes judged dead and the seat they were
            judged from.
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
        watched: Callable[[], Seat | None],
        on_dead: Callable[[list[str], Seat], None],
        event: Event,
    ) -> None:
        self._node = node
        self._liveness = liveness
        self._interval = interval
        self._max_attempt = max_attempt
        self._dead_after = dead_after
        self._judge_every = judge_every
        self._clock = clock
        self._watched = watched
        self._on_dead = on_dead
        self._event = event
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._error: RendezvousConnectionError | None = None

    @property
    def running(self) -> bool:
        """Whether the thread is alive."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def start(self) -> None:
        """Start the thread unless it is running; a thread that ended is replaced.

        Starting afresh forgets why the last thread gave up.
        """
        with self._lock:
            if self.running:
                return
            self._error = None
            self._stop = threading.Event()
            self._thread = start_thread(
                self._run, args=(self._stop,), name=f"rdzv-keepalive-{self._node}"
            )

    def stop(self) -> None:
        """Stop the thread; wait for it at most :data:`STOP_WAIT` seconds.

        A beat or a judgement still in flight then (bounded by the interval)
        may finish after this returns; the thread makes no other call.
        """
        with self._lock:
            thread, self._thread = self._thread, None
            self._stop.set()
            self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(STOP_WAIT)

    def wake(self) -> None:
        """Start judging now: the round is confirmed, or its confirmation late (see the module)."""
        self._wake.set()

    @property
    def error(self) -> RendezvousConnectionError | None:
        """Why the keep-alive gave up, until it starts again; None if it did not."""
        return self._error

    def check(self) -> None:
        """Raise :attr:`error`, if the keep-alive gave up."""
        error = self._error
        if error is not None:
            raise error

    def _run(self, stop: threading.Event) -> None:
        # An autojump clock moves only while this thread waits on it.
        with self._clock.running():
            failures = 0
            last_ok = self._clock()
            # The first beat is due one interval after joining: an observer only
            # starts judging a node when a round completes, and a round that
            # forms within one interval needs no heartbeat traffic at all.
            next_beat = self._clock() + self._interval
            judged: tuple[int, dict[str, MarkWatch]] = (-1, {})
            while not stop.is_set():
                now = self._clock()
                if now >= next_beat:
                    # The beats of one failure streak share one budget: the
                    # dead-node bound since the last good beat, plus a call's grace.
                    with deadline_within(
                        last_ok + self._dead_after + CALL_GRACE - now, self._clock
                    ):
                        failures = self._beat(failures, stop)
                    if failures == 0:
                        last_ok = now
                    if failures >= self._max_attempt:
                        return
                    next_beat = now + self._interval
                try:
                    with deadline_within(self._dead_after, self._clock):
                        judged = self._judge(judged)
                except Exception as exc:  # noqa: BLE001 - supervised: retried on the next tick
                    self._event("judge-failed", judged[0], error=f"{type(exc).__name__}: {exc}")
                member = self._watched()
                if member is None:
                    # Nobody to judge (not a member yet): wake only to beat. A
                    # thousand joining handlers in one process would otherwise
                    # wake dozens of times a second each, for nothing.
                    woken = self._clock.wait(self._wake, max(0.0, next_beat - self._clock()))
                    self._wake.clear()
                    seat = self._watched()
                    if woken and seat is not None:
                        # The first reading of a new ring only sets its baseline:
                        # spread over one period, so that the members of a round
                        # confirmed at once do not all read at once.
                        period = ring_judge_period(
                            self._judge_every, self._interval, seat.world_size
                        )
                        left = max(0.0, next_beat - self._clock())
                        self._clock.wait(stop, min(left, period * jitter(0.0, 1.0)))
                else:
                    period = ring_judge_period(self._judge_every, self._interval, member.world_size)
                    pause = period * jitter(0.75, 1.25)
                    watches = judged[1] if judged[0] == member.round else {}
                    watch = None if member.successor is None else watches.get(member.successor)
                    if watch is not None:
                        # The reading that judges comes as the bound is reached,
                        # not up to a period after it.
                        # At least a millisecond: a rounding error short of the
                        # bound would otherwise be waited for again and again.
                        pause = min(pause, max(0.001, self._dead_after - watch.credited))
                    self._clock.wait(stop, pause)

    def _beat(self, failures: int, stop: threading.Event) -> int:
        """Beat once; return the number of failed beats in a row."""
        try:
            self._liveness.beat(self._node)
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
        member = self._watched()
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
            self._on_dead(dead, member)
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
