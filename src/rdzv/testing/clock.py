"""A fake monotonic clock for tests: time moves only when told to."""

from __future__ import annotations

import threading

__all__ = ["FakeClock"]


class FakeClock:
    """A monotonic clock that moves only by :meth:`advance`.

    Call the instance to read it, as you would call ``time.monotonic``.

    Args:
        start: The initial reading, in seconds.
    """

    def __init__(self, start: float = 1000.0) -> None:
        self._now = float(start)
        self._lock = threading.Lock()

    def __call__(self) -> float:
        """Return the current reading, in seconds."""
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> float:
        """Move the clock forward.

        Args:
            seconds: How far, >= 0.

        Returns:
            The new reading.

        Raises:
            ValueError: ``seconds`` is negative (a monotonic clock never goes back).
        """
        if seconds < 0:
            raise ValueError(f"a monotonic clock cannot go back; got advance({seconds!r})")
        with self._lock:
            self._now += seconds
            return self._now
