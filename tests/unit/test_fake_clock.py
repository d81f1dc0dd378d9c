import threading
import time

import pytest

from rdzv.testing import AutojumpClock, FakeClock


def test_fake_clock_moves_only_when_advanced() -> None:
    clock = FakeClock(start=5.0)
    assert clock() == 5.0
    assert clock() == 5.0
    assert clock.advance(2.5) == 7.5
    assert clock() == 7.5


def test_fake_clock_refuses_to_go_back() -> None:
    clock = FakeClock()
    with pytest.raises(ValueError, match=r"advance\(-1\)"):
        clock.advance(-1)


def test_a_sleep_moves_the_fake_clock_at_once() -> None:
    clock = FakeClock(start=0.0)
    clock.sleep(2.5)
    clock.sleep(-1.0)
    assert clock() == 2.5


def test_a_wait_ends_when_the_clock_reaches_its_end_or_the_event_is_set() -> None:
    clock = FakeClock(start=0.0)
    event = threading.Event()
    results: list[bool] = []
    waiter = threading.Thread(target=lambda: results.append(clock.wait(event, 1.0)))
    waiter.start()
    while clock.waiting == 0:
        time.sleep(0.001)
    assert clock.next_wake == 1.0
    clock.advance(0.5)
    assert clock.waiting == 1  # not due yet
    clock.advance(0.5)
    waiter.join(10)
    assert results == [False]
    event.set()
    assert clock.wait(event, 100.0) is True
    assert clock() == 1.0


def test_a_wait_nobody_moves_time_for_fails_instead_of_hanging() -> None:
    clock = FakeClock(hang_after=0.05)
    with pytest.raises(TimeoutError, match="nothing moved the fake clock"):
        clock.wait(threading.Event(), 1.0)


def test_an_autojump_clock_jumps_to_the_next_wake_up_once_every_running_thread_waits() -> None:
    with AutojumpClock(start=0.0) as clock:
        busy = threading.Event()
        ends: list[float] = []

        def sleeper(seconds: float) -> None:
            with clock.running():
                busy.wait(10)  # running and not waiting on the clock: time stands still
                clock.sleep(seconds)
                ends.append(clock())

        threads = [threading.Thread(target=sleeper, args=(s,)) for s in (5.0, 2.0)]
        for t in threads:
            t.start()
        time.sleep(0.05)
        assert clock() == 0.0
        busy.set()
        for t in threads:
            t.join(10)
        assert sorted(ends) == [2.0, 5.0]


def test_an_autojump_clock_moves_during_a_blocking_wait_only_to_its_end() -> None:
    with AutojumpClock(start=0.0) as clock:
        released = threading.Event()
        with clock.running(), clock.blocking(3.0):
            waiter = threading.Thread(target=lambda: clock.wait(released, 100.0))
            waiter.start()
            deadline = time.monotonic() + 10
            while clock() < 3.0:
                assert time.monotonic() < deadline, "the clock never moved"
                time.sleep(0.001)
            time.sleep(0.05)
            assert clock() == 3.0  # the blocking wait is due: time waits for it
        released.set()
        waiter.join(10)


def test_a_skewed_view_reads_the_offset_time_and_waits_on_the_shared_clock() -> None:
    clock = FakeClock(start=10.0)
    view = clock.skewed(-4.0)
    assert view() == 6.0
    view.sleep(1.0)
    assert (clock(), view()) == (11.0, 7.0)
