"""The keep-alive on a fake clock: beats, giving up and judgement counted in its clock's time.

The keep-alive thread waits on the injected :class:`~rdzv.testing.FakeClock`;
the test moves time straight to the thread's next wake-up, each time only
once the thread is parked in its wait again, so what the thread does is
decided by fake time alone, however loaded the machine is.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from rdzv.backends.base import LivenessBackend
from rdzv.dynamic.keepalive import KeepAlive
from rdzv.dynamic.seat import SealedMark, Seat
from rdzv.dynamic.state import RendezvousState
from rdzv.errors import RendezvousConnectionError
from rdzv.testing import FakeClock

pytestmark = pytest.mark.timeout(30)

INTERVAL = 1.0
ATTEMPTS = 3
DEAD_AFTER = INTERVAL * ATTEMPTS
JUDGE_EVERY = 0.075
ME, SUCCESSOR = "10.0.0.1#1#aa", "10.0.0.2#1#bb"


class Liveness(LivenessBackend):
    """Counts beats; fails them while ``failing``; the successor's mark is ``mark()``."""

    def __init__(self, mark: Callable[[], bytes | None] = lambda: b"1") -> None:
        self.beats = 0
        self.failed = 0
        self.failing = False
        self.mark = mark

    def beat(self, node: str) -> None:
        if self.failing:
            self.failed += 1
            raise RendezvousConnectionError("the backend is unreachable")
        self.beats += 1

    def heartbeat_mark(self, node: str) -> bytes | None:
        return self.mark()

    def forget(self, node: str) -> None:
        pass


class Run:
    """One keep-alive on a fake clock, watching ``SUCCESSOR`` in a round of two."""

    def __init__(
        self,
        liveness: Liveness,
        on_dead: Callable[[list[str]], None],
        world: int = 2,
        sealed: tuple[bytes | None, float] | None = None,
    ) -> None:
        """``sealed``: the seat's sealed mark and how long before the start this node read it."""
        self.clock = FakeClock()
        self.started = self.clock()
        self.events: list[tuple[str, dict[str, Any]]] = []
        others = tuple(f"10.1.{i // 250}.{i % 250}#1#cc" for i in range(world - 2))
        round_ = Seat.of(RendezvousState(0, (ME, SUCCESSOR, *others)), ME)
        assert round_ is not None
        if sealed is not None:
            mark, ago = sealed
            round_ = replace(round_, sealed_mark=SealedMark(mark, self.started - ago))
        self.keepalive = KeepAlive(
            ME,
            liveness,
            INTERVAL,
            ATTEMPTS,
            DEAD_AFTER,
            JUDGE_EVERY,
            self.clock,
            lambda dead, _member: on_dead(dead),
            lambda action, _round, **fields: self.events.append((action, fields)),
        )
        self.keepalive.judge_ring(round_)

    def _settle(self, parks: int) -> None:
        """Wait (real time, bounded) until the thread parked again after ``parks`` or ended."""
        limit = time.monotonic() + 10
        while self.keepalive.running and self.clock.parks <= parks:
            assert time.monotonic() < limit, "the keep-alive thread never waited again"
            time.sleep(0.0005)

    def drive(self, until: Callable[[], bool], seconds: float) -> float:
        """Jump fake time from one wake-up of the thread to the next, until ``until()``.

        Returns:
            The fake time passed since the keep-alive started.
        """
        end = self.started + seconds
        self._settle(0)
        while not until() and self.clock() < end:
            wake = self.clock.next_wake
            if wake is None:
                break  # the thread ended
            parks = self.clock.parks
            self.clock.advance(max(0.0, min(wake, end) - self.clock()))
            if wake > end:
                break
            self._settle(parks)
        return self.clock() - self.started

    def __enter__(self) -> Run:
        self.keepalive.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.keepalive.stop()


def test_the_keep_alive_beats_once_per_interval_of_its_clock() -> None:
    liveness = Liveness(mark=lambda: None)  # the successor is already gone: nothing to judge
    with Run(liveness, lambda dead: None) as run:
        run.drive(lambda: False, 10.0)
        # the first beat is due one interval in; ticks may add one judge period per beat
        assert 8 <= liveness.beats <= 10, liveness.beats


def test_the_keep_alive_gives_up_after_max_attempt_failed_beats_not_sooner() -> None:
    liveness = Liveness(mark=lambda: None)
    liveness.failing = True
    with Run(liveness, lambda dead: None) as run:
        took = run.drive(lambda: run.keepalive.error is not None, 30.0)
        assert run.keepalive.error is not None
        assert liveness.failed == ATTEMPTS
        assert "3 failed keep-alive heartbeats in a row" in str(run.keepalive.error)
        # beats at 1, 2 and 3 intervals in (plus the ticks' lag), never before the third
        assert INTERVAL * ATTEMPTS <= took <= INTERVAL * (ATTEMPTS + 1), took
        assert not run.keepalive.running


def test_a_silent_successor_is_judged_dead_after_the_bound_and_not_before() -> None:
    judged: list[float] = []
    with Run(Liveness(), lambda dead: judged.append(run.clock())) as run:
        run.drive(lambda: bool(judged), 30.0)
        assert judged, "the successor was never judged dead"
        took = judged[0] - run.started
        # readings come every judge period (with jitter up to a quarter more)
        assert DEAD_AFTER <= took <= DEAD_AFTER + 3 * JUDGE_EVERY, took


def test_in_a_large_ring_a_silent_successor_is_judged_at_the_bound_not_a_period_later() -> None:
    from rdzv.dynamic.pacing import ring_judge_period

    world = 1024
    period = ring_judge_period(JUDGE_EVERY, INTERVAL, world)
    assert period > 0.4  # readings half a second apart
    judged: list[float] = []
    with Run(Liveness(), lambda dead: judged.append(run.clock()), world) as run:
        run.drive(lambda: bool(judged), 30.0)
        assert judged, "the successor was never judged dead"
        took = judged[0] - run.started
        # the first reading is at the start; the one that judges lands on the bound
        assert DEAD_AFTER <= took <= DEAD_AFTER + 0.01, took


@pytest.mark.parametrize(
    ("sealed", "known"),
    [
        # The seat, read 1 s before the ring judging started, says the sealer
        # saw the mark the successor still has: 1 s of silence is known.
        pytest.param((b"1", 1.0), 1.0, id="read-1s-before"),
        # Time in which this node did not read is never all charged to the
        # successor: at most one interval of it counts.
        pytest.param((b"1", 60.0), INTERVAL, id="read-long-ago"),
        # The successor beat since the seal: its silence starts at this node's reading.
        pytest.param((None, 2.0), 0.0, id="beat-since"),
    ],
)
def test_a_sealed_mark_counts_the_silence_from_when_the_seat_was_read(
    sealed: tuple[bytes | None, float], known: float
) -> None:
    judged: list[float] = []
    with Run(Liveness(), lambda dead: judged.append(run.clock()), sealed=sealed) as run:
        run.drive(lambda: bool(judged), 30.0)
        assert judged, "the successor was never judged dead"
        took = judged[0] - run.started
        assert DEAD_AFTER - known <= took <= DEAD_AFTER - known + 3 * JUDGE_EVERY, took


def test_a_successor_that_beats_after_its_sealed_mark_is_never_judged_dead() -> None:
    beats = iter(range(1, 1_000_000))
    judged: list[list[str]] = []
    mark = lambda: str(next(beats)).encode()  # noqa: E731 - a new mark at every reading
    with Run(Liveness(mark=mark), judged.append, sealed=(b"0", DEAD_AFTER - 0.01)) as run:
        run.drive(lambda: False, 4 * DEAD_AFTER)
        assert judged == []


def test_a_successor_that_beats_is_never_judged_dead() -> None:
    beats = iter(range(1_000_000))
    judged: list[list[str]] = []
    with Run(Liveness(mark=lambda: str(next(beats)).encode()), judged.append) as run:
        run.drive(lambda: False, 4 * DEAD_AFTER)
        assert judged == []


def test_an_error_while_evicting_is_retried_and_never_stops_the_beats() -> None:
    calls = threading.Semaphore(0)

    def evict(dead: list[str]) -> None:
        calls.release()
        raise RendezvousConnectionError("the eviction's read was cut")

    liveness = Liveness()
    with Run(liveness, evict) as run:
        run.drive(lambda: False, 10.0)
        assert run.keepalive.running
        assert 8 <= liveness.beats <= 10, liveness.beats
        assert calls.acquire(blocking=False), "the dead successor was never handed over"
        assert any(action == "judge-failed" for action, _ in run.events)
