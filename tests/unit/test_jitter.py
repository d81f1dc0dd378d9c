"""rdzv's jitter draws from its own generator, never from the application's global one."""

from __future__ import annotations

import random

from rdzv.retry import Retry, jitter, poll_backoff
from rdzv.testing import FakeClock
from tests.unit.test_layering import _matches, all_imports


def test_jitter_stays_within_its_bounds() -> None:
    draws = [jitter(0.75, 1.25) for _ in range(2000)]
    assert min(draws) >= 0.75
    assert max(draws) <= 1.25
    assert max(draws) - min(draws) > 0.4  # it does vary


def test_backoffs_leave_a_seeded_global_random_sequence_as_it_was() -> None:
    # A training script seeds random for a reproducible run; rdzv's backoffs,
    # in its own threads, must not move that sequence.
    random.seed(1234)
    expected = [random.random() for _ in range(5)]
    random.seed(1234)
    for attempt in range(20):
        poll_backoff(attempt)
    retry = Retry(1.0, first=0.0001, clock=FakeClock())
    for _ in range(5):
        retry.pause()
    assert [random.random() for _ in range(5)] == expected


def test_only_rdzv_retry_imports_the_random_module() -> None:
    # Every other jitter (keep-alive ticks, the store client's reconnects,
    # a node's waits for a seal) goes through rdzv.retry.jitter.
    importers = sorted(m for m, imported in all_imports() if _matches(imported, "random"))
    assert importers == ["rdzv.retry"]
