"""Progress lines while an agent waits for the other nodes of its run.

Theory of operation: while the agent blocks in ``next_rendezvous()`` a
ticker thread prints one line :data:`FIRST_LINE_AFTER` seconds into the wait
and then every :data:`LINE_EVERY` seconds, and at once when the number of
joined nodes changes (once the wait has been reported: a rendezvous that
completes quickly stays silent). The numbers come from the dynamic
handler's structured events on the ``rdzv.dynamic`` logger (``join``,
``enqueue``, ``waiting``: how many joined, ``min_nodes``/``max_nodes``
(and ``target_nodes`` when a target is set: the line then counts toward it,
and a last call ends early when the target joins) and the seconds left until the join timeout and, during a last call, until it
ends), which :class:`EventListener` forwards; the events are INFO records,
so they arrive only while that logger is enabled for INFO (``rdzv run``
enables it). Without them, as for the static rendezvous, the line says how
long the agent has waited. During a last call (``min_nodes`` joined, fewer
than ``max_nodes``) the line gives the time left of it instead of the join
timeout's, when the round seals, and how many more nodes would seal it at
once. The ticker waits on the injected clock (:class:`rdzv.retry.Clock`), so
tests drive it on fake time.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from rdzv.retry import Clock, as_clock
from rdzv.threads import start_thread

__all__ = ["FIRST_LINE_AFTER", "LINE_EVERY", "EventListener", "WaitProgress"]

#: Seconds into a wait before its first progress line.
FIRST_LINE_AFTER = 2.0

#: Seconds between progress lines (a change of the joined count prints at once).
LINE_EVERY = 5.0


class WaitProgress:
    """Reports a wait for the other nodes of a run.

    Args:
        run_id: The run.
        log: Receives each progress line.
        first: Seconds into a wait before the first line.
        every: Seconds between lines.
        clock: The monotonic clock the ticker reads and waits on (a bare
            reading waits in real time).
    """

    def __init__(
        self,
        run_id: str,
        log: Callable[[str], None],
        first: float = FIRST_LINE_AFTER,
        every: float = LINE_EVERY,
        clock: Clock | Callable[[], float] = time.monotonic,
    ) -> None:
        self._run_id = run_id
        self._log = log
        self._first = first
        self._every = every
        self._clock = as_clock(clock)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._round: int | None = None
        self._joined: int | None = None
        self._limits: tuple[int, int] | None = None
        self._target: int | None = None
        self._deadline: float | None = None
        self._last_call_end: float | None = None
        self._changed = False

    def event(self, event: Mapping[str, Any]) -> None:
        """Take in one of the handler's events (any thread)."""
        action = event.get("action")
        with self._lock:
            if isinstance(event.get("round"), int) and action in ("join", "enqueue", "waiting"):
                self._round = event["round"]
            if action == "join":
                self._joined, self._deadline, self._last_call_end = None, None, None
            elif action == "waiting":
                joined, low, high = (event.get(k) for k in ("joined", "min_nodes", "max_nodes"))
                timeout_in, last_call_in = event.get("timeout_in"), event.get("last_call_in")
                if isinstance(joined, int) and isinstance(low, int) and isinstance(high, int):
                    self._changed = self._changed or joined != self._joined
                    self._joined, self._limits = joined, (low, high)
                    target = event.get("target_nodes")
                    self._target = target if isinstance(target, int) else None
                if isinstance(timeout_in, (int, float)):
                    self._deadline = self._clock() + timeout_in
                self._last_call_end = None
                if isinstance(last_call_in, (int, float)):
                    self._last_call_end = self._clock() + last_call_in
                self._wake.set()

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Report progress until the block ends."""
        stop = threading.Event()
        with self._lock:
            self._changed = False
        ticker = start_thread(self._tick, args=(stop,), name="rdzv-wait-progress")
        try:
            yield
        finally:
            stop.set()
            self._wake.set()
            ticker.join()

    def _tick(self, stop: threading.Event) -> None:
        started = self._clock()
        due = started + self._first
        reported = False
        while True:
            # Cleared before the checks: an event or a stop after them sets it again.
            self._wake.clear()
            if stop.is_set():
                return
            with self._lock:
                now = self._clock()
                ready = now >= due or (reported and self._changed)
                if ready:
                    self._changed = False
                    line = self._line(now - started, now)
            if not ready:
                self._clock.wait(self._wake, due - now)
                continue
            self._log(line)
            reported = True
            due = now + self._every

    def _line(self, waited: float, now: float) -> str:
        where = f"run {self._run_id!r}"
        if self._round is not None:
            where += f" (round {self._round})"
        text = f"waiting for the other nodes of {where}: {waited:.0f} s so far"
        if self._joined is not None and self._limits is not None:
            low, high = self._limits
            bounds = f"{low}" if low == high else f"min {low} / max {high}"
            if self._target is not None:
                bounds = f"target {self._target} ({bounds})"
                high = self._target
            text += f"; {self._joined} of {bounds} nodes joined"
            if self._last_call_end is not None and self._joined < high:
                left = self._last_call_end - now
                if left <= 0:
                    return f"{text}; last call: ended at {left + waited:.0f} s, sealing"
                more = high - self._joined
                nodes = "1 more node joins" if more == 1 else f"{more} more nodes join"
                return (
                    f"{text}; last call: {left:.0f} s left "
                    f"(sealing at {left + waited:.0f} s unless {nodes})"
                )
        if self._deadline is not None:
            text += f"; the join timeout ends in {max(0.0, self._deadline - now):.0f} s"
        return text


class EventListener(logging.Handler):
    """Forwards one node's rendezvous events from the ``rdzv.dynamic`` logger.

    Args:
        receive: Called with each event's fields.
        run_id: Only events of this run are forwarded.
        node: Only events of this node key are forwarded (any node when None).
    """

    LOGGER = "rdzv.dynamic"

    def __init__(
        self, receive: Callable[[Mapping[str, Any]], None], run_id: str, node: str | None
    ) -> None:
        super().__init__(logging.NOTSET)
        self._receive = receive
        self._run_id = run_id
        self._node = node

    def emit(self, record: logging.LogRecord) -> None:
        """Forward the record's event when it is this node's."""
        event = getattr(record, "rdzv_event", None)
        if not isinstance(event, Mapping) or event.get("run_id") != self._run_id:
            return
        if self._node is None or event.get("node") == self._node:
            self._receive(event)

    @contextlib.contextmanager
    def attached(self) -> Iterator[None]:
        """Listen while the block runs."""
        logger = logging.getLogger(self.LOGGER)
        logger.addHandler(self)
        try:
            yield
        finally:
            logger.removeHandler(self)
