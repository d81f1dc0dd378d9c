"""The shared ticker: many keep-alives' ticks on two threads, each task independent of the others.

The decisions (when a tick runs, when the standby takes over) run on an
:class:`~rdzv.testing.AutojumpClock`: its time moves only once every ticker
thread waits, so a tick's lag is fake time alone, however loaded the
machine. A hung backend call is a tick inside the clock's ``blocking``
wait, as the store clients' reads are. The last test puts two real
keep-alives on real time, one over a paused ``rdzv serve``.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from rdzv.backends.kv import StoreLiveness
from rdzv.dynamic.keepalive import KeepAlive
from rdzv.dynamic.ticker import TAKEOVER, Ticker, ticker_for
from rdzv.retry import Clock
from rdzv.store.server import TCPStoreServer
from rdzv.store.tcp import TCPStore
from rdzv.testing import AutojumpClock
from tests.procs import wait_until
from tests.store.helpers import serve_process

pytestmark = pytest.mark.timeout(60)

PERIOD = 1.0


@pytest.fixture
def clock() -> Iterator[AutojumpClock]:
    with AutojumpClock() as clock:
        yield clock


class Ticks:
    """Tasks that record the reading each tick ran at, and tick every ``PERIOD``."""

    def __init__(self, clock: Clock, period: float = PERIOD) -> None:
        self.clock = clock
        self.period = period
        self.ran: dict[int, list[float]] = {}
        self.hang: dict[int, threading.Event] = {}
        self.fail: set[int] = set()

    def tick(self, index: int) -> Callable[[], float | None]:
        def tick() -> float:
            now = self.clock()
            self.ran.setdefault(index, []).append(now)
            if index in self.fail:
                raise RuntimeError(f"task {index} failed")
            if index in self.hang:
                with self.clock.blocking(60.0):  # a backend read with a long timeout
                    self.hang[index].wait(30)
            return now + self.period

        return tick


def _lags(ran: list[float], first: float) -> list[float]:
    """How late each tick ran against a tick every PERIOD from ``first``."""
    return [at - (first + k * PERIOD) for k, at in enumerate(ran)]


def test_many_tasks_tick_on_time_on_two_threads(clock: AutojumpClock) -> None:
    ticker, ticks = Ticker(clock), Ticks(clock)
    start = clock()
    with clock.running():  # time stands still until all are scheduled
        tasks = [ticker.schedule(ticks.tick(i), start + i * 0.01) for i in range(50)]
    most = 0
    while clock() < start + 5:
        most = max(most, ticker.threads)
        time.sleep(0.001)
    for i in range(50):
        lags = _lags(ticks.ran[i], start + i * 0.01)
        assert len(lags) >= 4, (i, lags)
        assert max(lags) < 1e-6, (i, lags)
    assert most == 2  # the runner and its standby
    for task in tasks:
        task.cancel(1.0)
    assert ticker.threads == 0  # the last cancel waited for them


def test_one_task_runs_on_one_thread(clock: AutojumpClock) -> None:
    ticker, ticks = Ticker(clock), Ticks(clock)
    task = ticker.schedule(ticks.tick(0), clock())
    wait_until(lambda: len(ticks.ran.get(0, [])) >= 5)
    assert ticker.threads == 1
    task.cancel(1.0)
    assert ticker.threads == 0
    assert not task.active


def test_a_hung_tick_delays_another_task_by_the_takeover_at_most(clock: AutojumpClock) -> None:
    ticker, ticks = Ticker(clock), Ticks(clock)
    start = clock()
    ticks.hang[0] = threading.Event()
    with clock.running():  # time stands still until both are scheduled
        hung = ticker.schedule(ticks.tick(0), start)
        other = ticker.schedule(ticks.tick(1), start + 0.1)
    # Task 1 keeps ticking while task 0 hangs (60 s of fake time).
    wait_until(lambda: len(ticks.ran.get(1, [])) >= 5)
    lags = _lags(ticks.ran[1], start + 0.1)
    # Only its first tick waited for the standby to take over; the rest ran on time.
    assert TAKEOVER - 1e-6 < lags[0] <= TAKEOVER + 1e-6, lags
    assert max(lags[1:]) <= TAKEOVER + 1e-6, lags
    assert ticker.threads == 3  # the stuck thread, the new runner, a new standby
    ticks.hang[0].set()
    del ticks.hang[0]
    seen = len(ticks.ran[0])
    wait_until(lambda: len(ticks.ran[0]) >= seen + 3)  # the hung task ticks again
    wait_until(lambda: ticker.threads == 2)  # the thread left in the slow tick ended
    hung.cancel(1.0)
    other.cancel(1.0)
    assert ticker.threads == 0


def test_a_tick_that_raises_ends_its_task_alone(clock: AutojumpClock) -> None:
    ticker, ticks = Ticker(clock), Ticks(clock)
    ticks.fail.add(0)
    failing = ticker.schedule(ticks.tick(0), clock())
    other = ticker.schedule(ticks.tick(1), clock())
    wait_until(lambda: len(ticks.ran.get(1, [])) >= 5)
    assert not failing.active
    assert len(ticks.ran[0]) == 1
    assert other.active
    other.cancel(1.0)


class BrokenOnce(AutojumpClock):
    """An autojump clock whose first wait of a ticker thread raises."""

    def __init__(self) -> None:
        super().__init__()
        self.broke = threading.Event()

    def wait(self, event: threading.Event, seconds: float) -> bool:
        if threading.current_thread().name.startswith("rdzv-keepalive") and not self.broke.is_set():
            self.broke.set()
            raise RuntimeError("the clock broke")
        return super().wait(event, seconds)


def test_a_ticker_thread_that_fails_is_replaced() -> None:
    clock = BrokenOnce()
    try:
        ticker, ticks = Ticker(clock), Ticks(clock)
        task = ticker.schedule(ticks.tick(0), clock() + 1.0)
        wait_until(lambda: len(ticks.ran.get(0, [])) >= 3)
        assert clock.broke.is_set()
        task.cancel(1.0)
        assert ticker.threads == 0
    finally:
        clock.close()


def test_cancel_waits_for_the_tick_in_flight_but_not_from_inside_it(clock: AutojumpClock) -> None:
    ticker, ticks = Ticker(clock), Ticks(clock)
    ticks.hang[0] = threading.Event()
    task = ticker.schedule(ticks.tick(0), clock())
    wait_until(lambda: 0 in ticks.ran)
    began = time.monotonic()
    task.cancel(0.3)  # the tick hangs: the cancel gives up waiting
    assert 0.25 <= time.monotonic() - began < 5.0
    ticks.hang[0].set()
    wait_until(lambda: ticker.threads == 0)
    assert len(ticks.ran[0]) == 1

    def cancels_itself() -> None:
        own.cancel(30.0)

    own = ticker.schedule(cancels_itself, clock())
    began = time.monotonic()
    wait_until(lambda: not own.active)
    wait_until(lambda: ticker.threads == 0)
    assert time.monotonic() - began < 10.0


def test_tickers_are_per_clock_and_a_forked_child_starts_with_none() -> None:
    clock = Clock()  # real time: the child has no autojump thread
    ticker = ticker_for(clock)
    assert ticker_for(clock) is ticker
    assert ticker_for(Clock()) is not ticker
    ticks = Ticks(clock, period=0.01)
    task = ticker.schedule(ticks.tick(0), clock())
    wait_until(lambda: len(ticks.ran.get(0, [])) >= 2)
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status only
        ok = not task.active and ticker.threads == 0 and ticker_for(clock) is not ticker
        child = ticker_for(clock).schedule(ticks.tick(1), clock())
        deadline = time.monotonic() + 10
        while len(ticks.ran.get(1, [])) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        child.cancel(1.0)
        task.cancel(1.0)  # the parent's task, ended here: nothing to wait for
        os._exit(0 if ok and len(ticks.ran.get(1, [])) >= 3 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert task.active  # the parent's task goes on
    task.cancel(1.0)
    assert ticker.threads == 0


class TimedLiveness(StoreLiveness):
    """A store's liveness that records when each of its beats landed."""

    def __init__(self, store: TCPStore) -> None:
        super().__init__(store, "ticker/")
        self.store = store
        self.landed: list[float] = []

    def beat(self, node: str) -> None:
        super().beat(node)
        self.landed.append(time.monotonic())


@pytest.mark.slow
def test_a_paused_store_does_not_delay_another_handlers_beats() -> None:
    interval, attempts = 0.5, 3
    clock = Clock()  # both keep-alives on one clock: one ticker

    def keepalive(node: str, liveness: StoreLiveness) -> KeepAlive:
        return KeepAlive(
            node,
            liveness,
            interval,
            attempts,
            interval * attempts,
            interval,
            clock,
            lambda dead, seat: None,
            lambda action, round_id, **fields: None,
        )

    healthy_server = TCPStoreServer("127.0.0.1", 0).start()
    with serve_process() as (paused_server, port):
        healthy = TimedLiveness(TCPStore("127.0.0.1", healthy_server.port, timeout=30))
        stuck = TimedLiveness(TCPStore("127.0.0.1", port, timeout=30))
        os.kill(paused_server.pid, signal.SIGSTOP)
        try:
            one, two = keepalive("10.0.0.1#1#aa", stuck), keepalive("10.0.0.2#1#bb", healthy)
            one.start()
            two.start()
            began = time.monotonic()
            time.sleep(4.0)  # the stuck beat, from 0.5 s in, takes until its 6.5 s budget
            one.stop()  # gives up waiting for its hung beat after STOP_WAIT
            two.stop()
            landed_while_paused = list(stuck.landed)
        finally:
            os.kill(paused_server.pid, signal.SIGCONT)
        wait_until(lambda: ticker_for(clock).threads == 0)  # the hung beat returned
        for liveness in (healthy, stuck):
            liveness.store.close()
    healthy_server.stop()
    assert landed_while_paused == []
    gaps = [b - a for a, b in zip([began, *healthy.landed], healthy.landed, strict=False)]
    # A beat every interval; the first after one. Never near the dead-node bound (1.5 s).
    assert len(healthy.landed) >= 5, gaps
    assert max(gaps) < interval * attempts - interval / 2, gaps
