"""A fake monotonic clock for tests: time moves only when told to, and sleeps move it.

:class:`FakeClock` is a :class:`rdzv.retry.Clock`, so it can be injected
wherever the driver takes one (``DynamicRendezvousHandler(clock=...)``,
:class:`rdzv.dynamic.keepalive.KeepAlive`):

* :meth:`FakeClock.advance` moves time forward (a test drives it);
* :meth:`FakeClock.sleep` moves time forward by the sleep's length: the
  sleeper is what time waits on, so polls and backoffs take no real time;
* :meth:`FakeClock.wait` blocks a thread (a keep-alive tick) until its event
  is set or someone else moved time far enough.
"""

from __future__ import annotations

import threading
import time

from rdzv.retry import Clock

__all__ = ["FakeClock"]

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
        self._ends: list[float] = []
        self._parks = 0

    def __call__(self) -> float:
        """Return the current reading, in seconds."""
        with self._moved:
            return self._now

    def advance(self, seconds: float) -> float:
        """Move the clock forward and wake the waits that are due.

        Args:
            seconds: How far, >= 0.

        Returns:
            The new reading.

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
            return len(self._ends)

    @property
    def parks(self) -> int:
        """How many :meth:`wait` calls began so far (a test sees a thread park again)."""
        with self._moved:
            return self._parks

    @property
    def next_wake(self) -> float | None:
        """The reading at which the first blocked :meth:`wait` ends, or None."""
        with self._moved:
            return min(self._ends, default=None)

    def sleep(self, seconds: float) -> None:
        """Move the clock forward by ``seconds`` (when positive) and return at once.

        Args:
            seconds: How long the caller sleeps.
        """
        if seconds > 0:
            self.advance(seconds)

    def wait(self, event: threading.Event, seconds: float) -> bool:
        """Block until ``event`` is set or the clock moved ``seconds`` past now.

        Args:
            event: The event.
            seconds: The longest wait, in this clock's time.

        Returns:
            Whether the event is set.

        Raises:
            TimeoutError: Neither happened within ``hang_after`` real seconds.
        """
        hang_at = time.monotonic() + self._hang_after
        with self._moved:
            end = self._now + max(0.0, seconds)
            self._ends.append(end)
            self._parks += 1
            try:
                while not event.is_set() and self._now < end:
                    if time.monotonic() >= hang_at:
                        raise TimeoutError(
                            f"nothing moved the fake clock to {end:g} (it reads {self._now:g}) "
                            f"within {self._hang_after:g} real seconds"
                        )
                    self._moved.wait(_EVENT_POLL)
            finally:
                self._ends.remove(end)
        return event.is_set()
