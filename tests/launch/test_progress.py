"""Progress lines while an agent waits for the other nodes."""

from __future__ import annotations

import re
import threading
from datetime import datetime
from pathlib import Path

import pytest

from rdzv.launch.progress import EventListener, WaitProgress
from rdzv.testing import FakeClock
from tests.launch.procs import HELLO, agents, finish
from tests.procs import wait_until

pytestmark = pytest.mark.timeout(90)


class Lines:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, line: str) -> None:
        with self.lock:
            self.lines.append(line)

    def snapshot(self) -> list[str]:
        with self.lock:
            return list(self.lines)


def waiting(
    joined: int,
    timeout_in: float = 100.0,
    last_call_in: float | None = None,
    max_nodes: int = 4,
) -> dict[str, object]:
    return {
        "action": "waiting",
        "round": 3,
        "joined": joined,
        "min_nodes": 2,
        "max_nodes": max_nodes,
        "timeout_in": timeout_in,
        "last_call_in": last_call_in,
    }


def test_a_quick_rendezvous_prints_nothing() -> None:
    lines = Lines()
    progress = WaitProgress("job", lines, first=30.0, every=30.0)
    with progress.waiting():
        progress.event(waiting(1))
    assert lines.snapshot() == []


def test_lines_name_the_run_the_counts_and_the_time_left() -> None:
    lines = Lines()
    progress = WaitProgress("job", lines, first=0.05, every=0.1)
    with progress.waiting():
        progress.event({"action": "join", "round": 3})
        progress.event(waiting(1, timeout_in=100.0))
        wait_until(lambda: len(lines.snapshot()) >= 3, timeout=30, what="three lines")
    first = lines.snapshot()[0]
    assert first.startswith("waiting for the other nodes of run 'job' (round 3): ")
    assert "; 1 of min 2 / max 4 nodes joined; the join timeout ends in " in first
    match = re.search(r"ends in (\d+) s", first)
    assert match is not None
    left = int(match.group(1))
    assert 0 < left <= 100


def test_a_change_is_printed_at_once_after_the_first_line() -> None:
    lines = Lines()
    progress = WaitProgress("job", lines, first=0.05, every=3600.0)
    with progress.waiting():
        progress.event(waiting(1))
        wait_until(lambda: len(lines.snapshot()) == 1, timeout=30, what="the first line")
        progress.event(waiting(1))  # no change: no line
        progress.event(waiting(3))
        wait_until(lambda: len(lines.snapshot()) == 2, timeout=30, what="the change line")
    assert "1 of min 2 / max 4" in lines.snapshot()[0]
    assert "3 of min 2 / max 4" in lines.snapshot()[1]


def _parked(clock: FakeClock, parks: int) -> None:
    """Wait (real time, bounded) until the ticker waits on the fake clock for the ``parks``-th time."""
    wait_until(lambda: clock.parks >= parks and clock.waiting == 1, timeout=30, what="the ticker")


def test_a_last_call_line_gives_the_time_left_and_when_the_round_seals() -> None:
    clock = FakeClock()
    lines = Lines()
    progress = WaitProgress("job", lines, first=2.0, every=5.0, clock=clock)
    with progress.waiting():
        progress.event({"action": "join", "round": 3})
        progress.event(waiting(1, timeout_in=100.0, max_nodes=3))
        _parked(clock, 1)
        clock.advance(2.0)
        wait_until(lambda: len(lines.snapshot()) == 1, timeout=30, what="the first line")
        _parked(clock, 2)
        clock.advance(4.0)
        # 6 s into the wait a second node joins: the last call's 30 s begin.
        progress.event(waiting(2, timeout_in=94.0, last_call_in=24.0, max_nodes=3))
        wait_until(lambda: len(lines.snapshot()) == 2, timeout=30, what="the change line")
        _parked(clock, 3)
        clock.advance(5.0)
        wait_until(lambda: len(lines.snapshot()) == 3, timeout=30, what="the next line")
        _parked(clock, 4)
        clock.advance(25.0)  # past the end of the last call, not sealed yet
        wait_until(lambda: len(lines.snapshot()) == 4, timeout=30, what="a late line")
    head = "waiting for the other nodes of run 'job' (round 3): "
    two = "2 of min 2 / max 3 nodes joined; last call:"
    assert lines.snapshot() == [
        f"{head}2 s so far; 1 of min 2 / max 3 nodes joined; the join timeout ends in 98 s",
        f"{head}6 s so far; {two} 24 s left (sealing at 30 s unless 1 more node joins)",
        f"{head}11 s so far; {two} 19 s left (sealing at 30 s unless 1 more node joins)",
        f"{head}36 s so far; {two} ended at 30 s, sealing",
    ]


def test_the_last_call_line_counts_the_nodes_that_would_seal_at_once() -> None:
    clock = FakeClock()
    lines = Lines()
    progress = WaitProgress("job", lines, first=1.0, every=3600.0, clock=clock)
    with progress.waiting():
        progress.event(waiting(3, last_call_in=10.0, max_nodes=5))
        _parked(clock, 1)
        clock.advance(1.0)
        wait_until(lambda: len(lines.snapshot()) == 1, timeout=30, what="the first line")
        # A new join (the round sealed without this node) ends the last call.
        progress.event({"action": "join", "round": 4})
        progress.event(waiting(1, timeout_in=50.0, max_nodes=5))
        wait_until(lambda: len(lines.snapshot()) == 2, timeout=30, what="the change line")
    first, second = lines.snapshot()
    assert first.endswith(
        "3 of min 2 / max 5 nodes joined; last call: 9 s left (sealing at 10 s unless 2 more "
        "nodes join)"
    )
    assert second.endswith("1 of min 2 / max 5 nodes joined; the join timeout ends in 50 s")


def test_without_events_the_line_says_how_long() -> None:
    lines = Lines()
    progress = WaitProgress("static-job", lines, first=0.05, every=3600.0)
    with progress.waiting():
        wait_until(lines.snapshot, timeout=30, what="a line")
    assert re.fullmatch(
        r"waiting for the other nodes of run 'static-job': \d+ s so far", lines.snapshot()[0]
    )


def test_the_listener_forwards_only_its_nodes_events() -> None:
    import logging

    got: list[object] = []
    listener = EventListener(got.append, "job", "me")
    logger = logging.getLogger(EventListener.LOGGER)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with listener.attached():
            for run, node in (("job", "me"), ("job", "other"), ("other-job", "me")):
                event = {"run_id": run, "node": node, "action": "join"}
                logger.info("rdzv %s", event, extra={"rdzv_event": event})
            logger.info("no event")
    finally:
        logger.setLevel(level)
    assert got == [{"run_id": "job", "node": "me", "action": "join"}]
    assert listener not in logger.handlers


STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) rdzv run: (.*)$")


def stamped(path: Path) -> list[tuple[datetime, str]]:
    found = []
    for line in path.read_text().splitlines():
        match = STAMP.match(line)
        if match:
            when = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S.%f")
            found.append((when, match.group(2)))
    return found


@pytest.mark.slow
def test_a_waiting_agent_prints_its_first_progress_line_within_5_s(
    endpoint: str, tmp_path: Path
) -> None:
    args = [
        "--nnodes=2:3",
        f"--rdzv-endpoint={endpoint}",
        "--rdzv-id=job-progress",
        "--local-addr=127.0.0.1",
        "--rdzv-conf=last_call_timeout=3,join_timeout=60",
        "--log-level=info",
        HELLO,
    ]
    first_err = tmp_path / "first.err"
    with agents() as group:
        first = group.start(args, stderr_path=first_err)

        def progress() -> list[tuple[datetime, str]]:
            return [(t, m) for t, m in stamped(first_err) if m.startswith("waiting for")]

        wait_until(progress, timeout=60, what="a progress line")
        second = group.start(args)
        results = [finish(first), finish(second)]
    assert [code for code, _, _ in results] == [0, 0], results
    lines = stamped(first_err)
    joined = next(t for t, m in lines if '"action": "join"' in m)
    when, line = next((t, m) for t, m in lines if m.startswith("waiting for"))
    # The agent's own clock: when it started to wait and when it said so.
    assert (when - joined).total_seconds() <= 5.0, lines
    assert line.startswith("waiting for the other nodes of run 'job-progress' (round 0): ")
    assert "1 of min 2 / max 3 nodes joined; the join timeout ends in " in line
    # The second node started the 3 s last call: the line says what is left of it.
    assert any(
        "2 of min 2 / max 3 nodes joined; last call: " in m and "unless 1 more node joins)" in m
        for _, m in lines
    ), lines
