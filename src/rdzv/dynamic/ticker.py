"""The shared ticker: one thread per process runs the ticks of every keep-alive in it.

Theory of operation
-------------------
A *task* is a tick (a function that does one round of work and returns the
reading of the clock at which it is due again, or None when it ends) and
the time it is due. Each handler's keep-alive is one task
(:mod:`rdzv.dynamic.keepalive`). :func:`ticker_for` returns the process's
:class:`Ticker` for a clock (one for real time), which runs all the tasks
on that clock with two threads at most, whatever their number:

* **The runner** waits on the clock for the task due first, runs its tick
  inline and schedules the task again at the reading the tick returned.
  Ticks due together run one after another in the same thread, with no
  hand-off: a process of one agent runs one thread, as it did with a thread
  per keep-alive, and one of a thousand simulated agents runs two instead
  of a thousand (each started at its enqueue, and woken on its own).
* **The standby** keeps the tasks independent. While two tasks or more are
  scheduled it watches the runner, and when a task has been due for
  :data:`TAKEOVER` seconds while the runner has been inside one tick for as
  long (a backend call that hangs until its deadline), it becomes the
  runner and a new standby starts. The thread left in the slow tick
  schedules its task again when the tick returns, then stands by or ends.
  So one handler's slow or hung backend delays another's tick by at most
  :data:`TAKEOVER`, a small part of the slack a beat has before the
  dead-node bound (``max_attempt - 1`` intervals; 2 s at 1 s x 3).
* **Supervised.** A tick that raises ends its task, as an exception ended a
  keep-alive's own thread before (the keep-alive starts a new task at its
  next start); the thread goes on with the others. A thread whose own loop
  fails gives up its role, and a new thread takes it.
* **Bounded.** :meth:`Task.cancel` waits at most its ``wait`` for a tick
  in flight (never for the tick that cancels itself), and, when it removed
  the clock's last task, for the ticker's threads to end in the same time.
  The threads are daemons that block the main thread's signals
  (:func:`rdzv.threads.start_thread`) and end once no task is scheduled, so
  nothing outlives the last handler's close. A forked child starts with no
  ticker, and its copies of the parent's tasks are ended (their threads
  were not copied), so a keep-alive in the child starts afresh.

Every wait is on the ticker's clock, and the threads run inside its
:meth:`~rdzv.retry.Clock.running`, so a test on a fake clock decides when
ticks run and when the standby takes over by fake time alone.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import weakref
from collections.abc import Callable

from rdzv.retry import Clock
from rdzv.threads import start_thread

__all__ = ["TAKEOVER", "Task", "Ticker", "ticker_for"]

_REAL_TIME = Clock()

LOGGER = logging.getLogger("rdzv.dynamic")

TAKEOVER = 0.25
"""Seconds a task may be kept waiting past its due time by another task's tick.

Above a store's round trip on a loaded machine (a takeover costs a thread),
and well below the slack a beat has before the dead-node bound.
"""

Tick = Callable[[], "float | None"]


class Task:
    """One task of a :class:`Ticker` (made by :meth:`Ticker.schedule`)."""

    def __init__(self, ticker: Ticker, tick: Tick, due: float) -> None:
        self._ticker = ticker
        self.tick = tick
        # Scheduled: when it is due. Running: the earliest wake asked meanwhile.
        self.due = due
        self.version = 0
        self.running_in: threading.Thread | None = None
        self.ended = False
        self.idle = threading.Event()
        self.idle.set()

    @property
    def active(self) -> bool:
        """Whether the task is still scheduled or running (not cancelled, not ended)."""
        return not self.ended

    def wake(self, at: float) -> None:
        """Run the tick no later than the reading ``at`` (now, if it is running)."""
        self._ticker._wake(self, at)

    def cancel(self, wait: float) -> None:
        """Run no more ticks; wait at most ``wait`` real seconds for one in flight (see the module)."""
        self._ticker._cancel(self, wait)


_Role = str
_RUNNER, _STANDBY = "runner", "standby"


class Ticker:
    """Runs the ticks of many tasks on one clock (see the module); get one by :func:`ticker_for`."""

    def __init__(self, clock: Clock) -> None:
        # Weak: the registry's key. The tasks' ticks hold their clock.
        self._clock = weakref.ref(clock)
        self._lock = threading.Lock()
        self._heap: list[tuple[float, int, int, Task]] = []
        self._order = itertools.count()
        self._tasks: set[Task] = set()
        # Each thread by its token; None while it is being started.
        self._threads: dict[object, threading.Thread | None] = {}
        self._runner: object | None = None
        self._standby: object | None = None
        self._busy_since: float | None = None
        self._standby_until = float("inf")
        self._runner_wake = threading.Event()
        self._standby_wake = threading.Event()

    def schedule(self, tick: Tick, due: float) -> Task:
        """Run ``tick`` at the reading ``due``, then whenever it says, until it returns None."""
        task = Task(self, tick, due)
        with self._lock:
            self._tasks.add(task)
            self._push(task, due)
        self._ensure()
        return task

    @property
    def threads(self) -> int:
        """How many threads the ticker runs now."""
        with self._lock:
            return len(self._threads)

    # -- the tasks' side (under no lock of the ticker) ------------------------

    def _wake(self, task: Task, at: float) -> None:
        with self._lock:
            if task.ended or at >= task.due:
                return
            if task.running_in is not None:
                task.due = at
                return
            self._push(task, at)
        self._ensure()

    def _cancel(self, task: Task, wait: float) -> None:
        until = _REAL_TIME() + wait  # thread joins wait real time
        with self._lock:
            task.ended = True
            self._tasks.discard(task)
            running = task.running_in
            last = not self._tasks
            if last:
                self._runner_wake.set()
                self._standby_wake.set()
            threads = list(self._threads.values()) if last else []
        me = threading.current_thread()
        if running is not None and running is not me:
            task.idle.wait(wait)
        for thread in threads:
            if thread is not None and thread is not me:
                thread.join(max(0.0, until - _REAL_TIME()))

    # -- bookkeeping (under the lock) ----------------------------------------

    def _push(self, task: Task, due: float) -> None:
        task.due = due
        task.version += 1
        first = self._peek()
        heapq.heappush(self._heap, (due, next(self._order), task.version, task))
        if first is None or due < first.due:
            self._runner_wake.set()
        if due + TAKEOVER < self._standby_until:
            # It would take over later than this task needs: it plans again.
            # (Not at every push: a thousand wakes at a verdict wake it once.)
            self._standby_wake.set()

    def _peek(self) -> Task | None:
        """Return the task due first, dropping the heap's stale entries."""
        heap = self._heap
        while heap:
            _, _, version, task = heap[0]
            if not task.ended and version == task.version and task.running_in is None:
                return task
            heapq.heappop(heap)
        return None

    def _ensure(self) -> None:
        """Start the runner, and the standby, that the scheduled tasks need (call it unlocked).

        The threads start after the lock is released: a start waits until
        the new thread runs, and on a loaded machine every handler that
        enqueued meanwhile waited for the lock behind it.
        """
        if self._runner is not None and (self._standby is not None or len(self._tasks) < 2):
            return  # read unlocked after the caller's change: see both roles filled
        roles = []
        with self._lock:
            if self._peek() is not None:
                if self._runner is None:
                    self._runner = object()
                    roles.append((self._runner, _RUNNER))
                if self._standby is None and len(self._tasks) > 1:
                    self._standby = object()
                    roles.append((self._standby, _STANDBY))
            self._threads.update((me, None) for me, _ in roles)
        for me, role in roles:
            thread = start_thread(self._serve, args=(me, role), name=f"rdzv-keepalive-{role}")
            with self._lock:
                if me in self._threads:  # unless it ended already
                    self._threads[me] = thread

    # -- the threads ---------------------------------------------------------

    def _serve(self, me: object, role: _Role | None) -> None:
        clock = self._clock()
        try:
            if clock is not None:
                with clock.running():
                    while role is not None:
                        if role == _RUNNER:
                            self._run(me, clock)
                        else:
                            self._stand_by(me, clock)
                        role = self._next_role(me)
        except Exception:
            LOGGER.exception("rdzv keep-alive ticker thread failed; another takes its place")
        finally:
            with self._lock:
                failed = me in self._threads
                if failed:  # a new thread takes its role
                    self._leave(me)
            if failed:
                self._ensure()

    def _leave(self, me: object) -> None:
        del self._threads[me]
        if self._runner is me:
            self._runner, self._busy_since = None, None
        if self._standby is me:
            self._standby = None

    def _next_role(self, me: object) -> _Role | None:
        """Return what a thread that left its role does next: run, stand by, or end."""
        with self._lock:
            if self._runner is None and self._peek() is not None:
                self._runner = me
            if self._runner is me:  # or it took over from a stuck runner
                return _RUNNER
            if self._standby is None and self._runner is not None and len(self._tasks) > 1:
                self._standby = me
                return _STANDBY
            self._leave(me)
            return None

    def _run(self, me: object, clock: Clock) -> None:
        """Run due ticks until another thread took over or nothing is scheduled."""
        while True:
            with self._lock:
                if self._runner is not me:
                    return
                self._busy_since = None
                task = self._peek()
                if task is None:
                    self._runner = None
                    return
                now = clock()
                wait = task.due - now
                if wait > 0:
                    self._runner_wake.clear()
                else:
                    heapq.heappop(self._heap)
                    self._busy_since = now
                    task.running_in, task.due = threading.current_thread(), float("inf")
                    task.idle.clear()
            if wait > 0:
                clock.wait(self._runner_wake, wait)
            else:
                self._tick(task)

    def _tick(self, task: Task) -> None:
        due: float | None = None
        try:
            due = task.tick()
        except Exception:  # supervised: the task ends, the thread goes on
            LOGGER.exception(
                "rdzv keep-alive tick failed; its keep-alive ends until it starts again"
            )
        finally:
            with self._lock:
                task.running_in = None
                if not task.ended:
                    if due is None:
                        task.ended = True
                        self._tasks.discard(task)
                    else:
                        self._push(task, min(due, task.due))
                task.idle.set()
            self._ensure()

    def _stand_by(self, me: object, clock: Clock) -> None:
        """Watch the runner until this thread takes over from it, or is not needed."""
        while True:
            with self._lock:
                task = self._peek()
                if self._standby is not me or len(self._tasks) < 2 or task is None:
                    if self._standby is me:
                        self._standby = None
                    return
                now = clock()
                busy = self._busy_since
                if self._runner is None or (
                    busy is not None and now >= max(task.due, busy) + TAKEOVER
                ):
                    # The runner is stuck in one tick while another is due: take over.
                    self._standby, self._runner, self._busy_since = None, me, None
                    break
                self._standby_wake.clear()
                self._standby_until = max(task.due, now if busy is None else busy) + TAKEOVER
            clock.wait(self._standby_wake, self._standby_until - now)
        self._ensure()  # a new standby


_TICKERS: weakref.WeakKeyDictionary[Clock, Ticker] = weakref.WeakKeyDictionary()
_REGISTRY = threading.Lock()


def ticker_for(clock: Clock) -> Ticker:
    """Return this process's ticker for ``clock``."""
    with _REGISTRY:
        ticker = _TICKERS.get(clock)
        if ticker is None:
            ticker = _TICKERS[clock] = Ticker(clock)
        return ticker


def _forget_after_fork() -> None:
    """In a forked child: end the parent's tasks (their threads are not here) and its tickers."""
    global _REGISTRY  # the parent's lock may have been held at the fork
    _REGISTRY = threading.Lock()
    for ticker in list(_TICKERS.values()):
        ticker._lock = threading.Lock()
        for task in ticker._tasks:
            task.ended, task.running_in, task.idle = True, None, threading.Event()
            task.idle.set()
        ticker._tasks.clear()
        ticker._heap.clear()
        ticker._threads.clear()
        ticker._runner = ticker._standby = ticker._busy_since = None
    _TICKERS.clear()


os.register_at_fork(after_in_child=_forget_after_fork)
