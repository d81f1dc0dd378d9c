"""Fake monotonic clocks for tests: time moves only when told to, or when every thread waits.

:class:`FakeClock` is a :class:`rdzv.retry.Clock`, so it can be injected
wherever the driver takes one (``DynamicRendezvousHandler(clock=...)``,
:class:`rdzv.dynamic.keepalive.KeepAlive`):

* :meth:`FakeClock.advance` moves time forward (a test drives it);
* :meth:`FakeClock.sleep` moves time forward by the sleep's length: the
  sleeper is what time waits on, so polls and backoffs take no real time;
* :meth:`FakeClock.wait` blocks a thread (a keep-alive tick) until its event
  is set or someone else moved time far enough;
* :meth:`FakeClock.skewed` is one node's view of the same time, offset.

:class:`AutojumpClock` moves by itself, as trio's
``MockClock(autojump_threshold=0)`` does for tasks: the threads that run on
it (inside :meth:`~rdzv.retry.Clock.running`: a handler's joins and its
keep-alive) are its sleepers, and once every one of them waits on the
clock (or in a :meth:`~rdzv.retry.Clock.blocking` wait not yet due), it
jumps to the earliest end of those waits. A handler on it forms rounds,
judges deaths and times out on fake time alone, however loaded the machine,
and sleeps nowhere.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Iterator

from rdzv.retry import Clock

__all__ = ["AutojumpClock", "FakeClock"]

_EVENT_POLL = 0.001
"""Real seconds between checks of a waited-for event (an Event cannot wake a Condition)."""


class FakeClock(Clock):
    """A monotonic clock that moves only by :meth:`advance` and :meth:`sleep`.

    Call the instance to read it, as you would call ``time.monotonic``.

    Args:
        start: The initial reading, in seconds.
        hang_after: Real seconds a :meth:`wait` may block without the clock
            reaching its end or the event being set before it raises (a test
            that forgot to move time fails instead of hanging).
    """

    def __init__(self, start: float = 1000.0, hang_after: float = 60.0) -> None:
        super().__init__()
        self._now = float(start)
        self._hang_after = hang_after
        self._moved = threading.Condition()
        # Each waiting thread: (the reading its wait ends at, its event or None).
        self._parked: dict[int, tuple[float, threading.Event | None]] = {}
        self._parks = 0

    def __call__(self) -> float:
        """Return the current reading, in seconds."""
        with self._moved:
            return self._now

    def advance(self, seconds: float) -> float:
        """Move the clock forward by ``seconds``, wake the waits that are due; return the reading.

        Raises:
            ValueError: ``seconds`` is negative (a monotonic clock never goes back).
        """
        if seconds < 0:
            raise ValueError(f"a monotonic clock cannot go back; got advance({seconds!r})")
        with self._moved:
            self._now += seconds
            self._moved.notify_all()
            return self._now

    @property
    def waiting(self) -> int:
        """How many threads are blocked in :meth:`wait`."""
        with self._moved:
            return len(self._parked)

    @property
    def parks(self) -> int:
        """How many :meth:`wait` calls began so far (a test sees a thread park again)."""
        with self._moved:
            return self._parks

    @property
    def next_wake(self) -> float | None:
        """The reading at which the first blocked :meth:`wait` ends, or None."""
        with self._moved:
            return min((end for end, _ in self._parked.values()), default=None)

    def sleep(self, seconds: float) -> None:
        """Move the clock forward by ``seconds`` (when positive) and return at once."""
        if seconds > 0:
            self.advance(seconds)

    def wait(self, event: threading.Event, seconds: float) -> bool:
        """Block until ``event`` is set or the clock moved ``seconds`` past now; True if set.

        Raises:
            TimeoutError: Neither happened within ``hang_after`` real seconds.
        """
        hang_at = time.monotonic() + self._hang_after
        with self._parking(seconds, event) as end:
            while not event.is_set() and self._now < end:
                if time.monotonic() >= hang_at:
                    raise TimeoutError(
                        f"nothing moved the fake clock to {end:g} (it reads {self._now:g}) "
                        f"within {self._hang_after:g} real seconds"
                    )
                self._moved.wait(_EVENT_POLL)
        return event.is_set()

    @contextlib.contextmanager
    def _parking(self, seconds: float, event: threading.Event | None) -> Iterator[float]:
        """Hold the lock and count the calling thread as waiting until the reading it yields."""
        me = threading.get_ident()
        with self._moved:
            end = self._now + max(0.0, seconds)
            self._parked[me] = (end, event)
            self._parks += 1
            try:
                yield end
            finally:
                del self._parked[me]

    def skewed(self, offset: float) -> Clock:
        """Return one node's view of this clock: its reading plus ``offset``, waits on this one."""
        return _Skewed(self, offset)


class AutojumpClock(FakeClock):
    """A :class:`FakeClock` that jumps to the next wake-up once every running thread waits on it.

    Its sleeps park the sleeper until time gets there (they do not move
    time themselves). Close it (or use it as a context manager) to stop the
    thread that moves it.

    Args:
        start: The initial reading, in seconds.
        hang_after: As for :class:`FakeClock`.
        pace: Real seconds between two looks at the waiting threads.
    """

    def __init__(
        self, start: float = 1000.0, hang_after: float = 60.0, pace: float = 0.001
    ) -> None:
        super().__init__(start, hang_after)
        self._running: Counter[int] = Counter()
        self._closed = threading.Event()
        self._pace = pace
        self._mover = threading.Thread(target=self._move, name="rdzv-autojump", daemon=True)
        self._mover.start()

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Count the calling thread, for the block, as a sleeper: time waits for it to wait."""
        me = threading.get_ident()
        with self._moved:
            self._running[me] += 1
        try:
            yield
        finally:
            with self._moved:
                self._running[me] -= 1
                if not self._running[me]:
                    del self._running[me]

    @contextlib.contextmanager
    def blocking(self, seconds: float) -> Iterator[None]:
        """Count the calling thread as waiting until ``seconds`` from now, while the block runs.

        A block inside another (a backend's wait inside the driver's) counts
        until its own end, then the outer one's again.
        """
        me = threading.get_ident()
        with self._moved:
            outer = self._parked.get(me)
            self._parked[me] = (self._now + max(0.0, seconds), None)
        try:
            yield
        finally:
            with self._moved:
                if outer is None:
                    self._parked.pop(me, None)
                else:
                    self._parked[me] = outer

    def sleep(self, seconds: float) -> None:
        """Wait until the clock moved ``seconds`` on (nothing happens when not positive)."""
        if seconds > 0:
            self.wait(threading.Event(), seconds)

    def _move(self) -> None:
        while not self._closed.wait(self._pace):
            with self._moved:
                ends = {
                    thread: end
                    for thread, (end, event) in self._parked.items()
                    if end > self._now and (event is None or not event.is_set())
                }
                if ends and all(thread in ends for thread in self._running):
                    self._now = min(ends.values())
                    self._moved.notify_all()

    def close(self) -> None:
        """Stop moving the clock."""
        self._closed.set()
        self._mover.join()

    def __enter__(self) -> AutojumpClock:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class _Skewed(Clock):
    """A view of a :class:`FakeClock` offset by a constant (see :meth:`FakeClock.skewed`)."""

    def __init__(self, base: FakeClock, offset: float) -> None:
        super().__init__()
        self._base, self._offset = base, offset

    def __call__(self) -> float:
        return self._base() + self._offset

    def sleep(self, seconds: float) -> None:
        self._base.sleep(seconds)

    def wait(self, event: threading.Event, seconds: float) -> bool:
        return self._base.wait(event, seconds)

    def running(self) -> contextlib.AbstractContextManager[None]:
        return self._base.running()

    def blocking(self, seconds: float) -> contextlib.AbstractContextManager[None]:
        return self._base.blocking(seconds)
