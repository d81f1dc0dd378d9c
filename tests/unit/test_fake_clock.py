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
