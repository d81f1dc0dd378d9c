"""rdzv's jitter draws from its own generator, never from the application's global one."""

from __future__ import annotations

import ast
import random
from pathlib import Path

from rdzv.retry import Retry, jitter, poll_backoff

SRC = Path(__file__).resolve().parents[2] / "src" / "rdzv"


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
    retry = Retry(1.0, first=0.0001, sleep=lambda _s: None)
    for _ in range(5):
        retry.pause()
    assert [random.random() for _ in range(5)] == expected


def test_only_rdzv_retry_imports_the_random_module() -> None:
    # Every other jitter (keep-alive ticks, the store client's reconnects,
    # a node's waits for a seal) goes through rdzv.retry.jitter.
    importers = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if "random" in names:
                importers.append(str(path.relative_to(SRC)))
    assert importers == ["retry.py"]
