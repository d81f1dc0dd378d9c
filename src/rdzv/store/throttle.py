"""The store server's log: one logger, with the warnings a flood can repeat throttled.

A flood of connections must not become a flood of log lines. The kinds of
warning a peer can repeat at the rate it connects (refusals, reclaimed and
expired handshakes, accept errors, any disconnect before the handshake is
done) are written at most once per interval each, with a count of those
held back. Every line goes to the logger ``rdzv.store.server``, whichever
of the server's modules writes it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

__all__ = ["ThrottledLog"]

_log = logging.getLogger("rdzv.store.server")


class ThrottledLog:
    """The server's warnings, those of a named kind at most once per ``interval`` seconds of ``clock``."""

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._interval = interval
        self._clock = clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warning(self, kind: str | None, message: str, *args: object) -> None:
        """Log ``message % args``, unless a line of ``kind`` was logged within the interval.

        A ``kind`` of None is logged always.
        """
        if kind is not None:
            now = self._clock()
            last = self._last.get(kind)
            if last is not None and now - last < self._interval:
                self._held[kind] = self._held.get(kind, 0) + 1
                return
            self._last[kind] = now
            held = self._held.pop(kind, 0)
            if held:
                message += " (and %d more like it since the last such line)"
                args = (*args, held)
        _log.warning(message, *args)
