"""The store server's throttled log, on a fake clock."""

from __future__ import annotations

import logging

import pytest

from rdzv.store.throttle import ThrottledLog


def test_a_kind_is_logged_once_per_interval_with_a_count_of_those_held_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    throttled = ThrottledLog(10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="rdzv.store.server"):
        throttled.warning("refused", "client %s refused", "a")
        throttled.warning("refused", "client %s refused", "b")
        throttled.warning("shed", "client %s shed", "c")
        throttled.warning(None, "client %s closed", "d")
        throttled.warning(None, "client %s closed", "e")
        now[0] += 9.9
        throttled.warning("refused", "client %s refused", "f")
        now[0] += 0.1
        throttled.warning("refused", "client %s refused", "g")
        throttled.warning("refused", "client %s refused", "h")
    assert [(r.name, r.getMessage()) for r in caplog.records] == [
        ("rdzv.store.server", "client a refused"),
        ("rdzv.store.server", "client c shed"),
        ("rdzv.store.server", "client d closed"),
        ("rdzv.store.server", "client e closed"),
        ("rdzv.store.server", "client g refused (and 2 more like it since the last such line)"),
    ]
