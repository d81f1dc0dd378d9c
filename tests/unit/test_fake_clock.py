import threading
import time

import pytest

from rdzv.testing import FakeClock


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
