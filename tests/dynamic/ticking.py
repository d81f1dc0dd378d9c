"""Handlers (threads) in one process on one shared fake clock, moved by a :class:`Ticker`.

Every node reads the shared :class:`~rdzv.testing.FakeClock` through a
:class:`NodeClock` (its own offset, for skew). The :class:`Ticker` moves the
clock to its next wake-up only once every running keep-alive thread is parked
on it again, so who is judged dead is decided by fake time alone, however
loaded the machine is. The in-memory backend's waits run on the node's clock
too (a join waiting for its last call parks on it); the store's waits stay
real, so the Ticker paces fake time (one wake-up per ``PACE`` real seconds at
most) and joins get a join timeout of ``FAKE_JOIN`` fake seconds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from rdzv.dynamic.handler import DynamicRendezvousHandler
from rdzv.retry import Clock
from rdzv.testing import FakeClock

HANG_AFTER = 10.0
"""Real seconds :meth:`Ticker.until` waits at most."""
PACE = 0.002
"""Real seconds the Ticker lets pass at least between two moves of the fake clock."""
FAKE_JOIN = 3600.0
"""The join timeout, in fake seconds, of tests on the fake clock (never reached)."""


class NodeClock(Clock):
    """One node's view of a shared :class:`FakeClock`: offset by ``skew``, sleeps park.

    A sleep parks on the shared clock until the Ticker moves it there (a
    sleeping node does not move everybody's time). The clock knows which
    threads are parked on it, and until when.
    """

    def __init__(self, base: FakeClock, skew: float = 0.0) -> None:
        super().__init__()
        self.base, self.skew = base, skew
        self._parked: dict[int, tuple[float, threading.Event]] = {}
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return self.base() + self.skew

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            self.wait(threading.Event(), seconds)

    def wait(self, event: threading.Event, seconds: float) -> bool:
        me = threading.get_ident()
        with self._lock:
            self._parked[me] = (self.base() + max(0.0, seconds), event)
        try:
            return self.base.wait(event, seconds)
        finally:
            with self._lock:
                del self._parked[me]

    def is_parked(self, thread: threading.Thread | None) -> bool:
        """Whether ``thread`` is None, ended, or parked on this clock and not yet due.

        A thread whose wait is due (its end passed or its event set) is about
        to run, even before it leaves the wait.
        """
        if thread is None or not thread.is_alive():
            return True
        with self._lock:
            parked = self._parked.get(thread.ident or 0)
        if parked is None:
            return False
        end, event = parked
        return end > self.base() and not event.is_set()


class Ticker:
    """Moves a FakeClock to its next wake-up whenever every node's keep-alive is parked."""

    def __init__(
        self, clock: FakeClock, nodes: Sequence[tuple[NodeClock, DynamicRendezvousHandler]]
    ) -> None:
        self.clock, self.nodes = clock, nodes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ticker", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(PACE):
            wake = self.clock.next_wake
            if wake is None or not all(
                node_clock.is_parked(h._keepalive._thread) for node_clock, h in list(self.nodes)
            ):
                continue
            self.clock.advance(max(0.0, wake - self.clock()))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def until(self, reading: float) -> None:
        """Block (real time, bounded) until the fake clock reads ``reading``."""
        limit = time.monotonic() + HANG_AFTER
        while self.clock() < reading:
            assert time.monotonic() < limit, f"the fake clock never reached {reading:g}"
            time.sleep(PACE)
