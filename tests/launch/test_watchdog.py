"""The progress watchdog: the verdicts on a fake clock, the worker's beacon, the stacks.

:class:`ProgressJudge` and :class:`ProgressBeacon` run on fake clocks; the
watch itself (:class:`HangWatch`) runs on a fake clock over real worker
processes, whose stacks it must capture whatever they are stuck in.
"""

from __future__ import annotations

import io
import os
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rdzv.launch.exits import WorkerExit
from rdzv.launch.timers import ENABLE_VARIABLE, FILE_VARIABLE
from rdzv.launch.watchdog import HangWatch, ProgressJudge, progress_every, stack_report
from rdzv.launch.workers import OutputSink, WorkerGroup, WorkerSpec
from rdzv.testing.clock import FakeClock
from rdzv.worker import (
    PROGRESS_DIR_VARIABLE,
    PROGRESS_EVERY_VARIABLE,
    ProgressBeacon,
    beacon_from_environment,
    progress_file,
)
from tests.procs import subprocess_env, wait_until

pytestmark = pytest.mark.timeout(60)


def test_the_write_period_is_a_tenth_of_the_timeout_at_most_a_second() -> None:
    assert progress_every(2.0) == pytest.approx(0.2)
    assert progress_every(10.0) == 1.0
    assert progress_every(600.0) == 1.0


def test_a_rank_is_not_judged_before_its_first_progress_mark() -> None:
    judge = ProgressJudge(timeout=10.0, slack=1.0)
    judge.observe(0, b"", 0.0)
    assert judge.hung([0], 1000.0) is None


def test_a_rank_silent_for_timeout_plus_slack_is_hung_not_before() -> None:
    judge = ProgressJudge(timeout=10.0, slack=1.0)
    judge.observe(0, b"1", 100.0)
    judge.observe(0, b"1", 105.0)  # the same mark: no progress
    assert judge.hung([0], 110.999) is None
    assert judge.hung([0], 111.0) == 0


def test_a_changed_mark_restarts_the_count_from_when_the_agent_saw_it() -> None:
    judge = ProgressJudge(timeout=10.0, slack=0.5)
    judge.observe(0, b"1", 100.0)
    judge.observe(0, b"2", 109.0)
    assert judge.hung([0], 119.0) is None
    assert judge.hung([0], 119.5) == 0
    judge.observe(0, b"3", 119.6)
    assert judge.hung([0], 120.0) is None


def test_only_running_ranks_are_judged_and_the_longest_silent_is_named() -> None:
    judge = ProgressJudge(timeout=5.0, slack=0.0)
    judge.observe(0, b"1", 10.0)
    judge.observe(1, b"1", 3.0)
    judge.observe(2, b"1", 7.0)
    assert judge.hung([0, 1, 2], 20.0) == 1
    assert judge.hung([0, 2], 20.0) == 2  # rank 1 ended: not judged
    assert judge.hung([0, 2], 11.0) is None
    judge.reset()
    assert judge.hung([0, 1, 2], 100.0) is None


def test_the_beacon_writes_at_most_once_per_period(tmp_path: Path) -> None:
    clock = FakeClock()
    path = tmp_path / "rank_0.progress"
    beacon = ProgressBeacon(path, every=1.0, clock=clock)
    assert not path.exists()
    beacon.mark()
    first = path.read_bytes()
    assert first.strip().isdigit()
    clock.advance(0.5)
    beacon.mark()
    assert path.read_bytes() == first
    clock.advance(0.5)
    beacon.mark()
    second = path.read_bytes()
    assert second != first
    assert len(second) == len(first)


def test_a_beacon_that_cannot_write_warns_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    clock = FakeClock()
    beacon = ProgressBeacon(tmp_path / "missing" / "rank_0.progress", every=1.0, clock=clock)
    for _ in range(3):
        beacon.mark()
        clock.advance(1.0)
    err = capsys.readouterr().err
    assert err.count("rdzv.progress(): cannot write the progress file") == 1


def test_the_beacon_comes_from_the_environment_or_not_at_all(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert beacon_from_environment({}) is None
    assert beacon_from_environment({"RANK": "0"}) is None
    good = {PROGRESS_DIR_VARIABLE: str(tmp_path), PROGRESS_EVERY_VARIABLE: "0.5", "RANK": "3"}
    beacon = beacon_from_environment(good)
    assert beacon is not None
    beacon.mark()
    assert progress_file(tmp_path, 3).exists()
    assert capsys.readouterr().err == ""
    for bad in ({"RANK": "x"}, {PROGRESS_EVERY_VARIABLE: "0"}, {PROGRESS_EVERY_VARIABLE: "y"}):
        assert beacon_from_environment({**good, **bad}) is None
        assert "rdzv.progress(): ignored" in capsys.readouterr().err


def test_progress_is_a_cheap_no_op_outside_rdzv_run() -> None:
    code = (
        "import sys, rdzv\n"
        "for _ in range(1000): rdzv.progress()\n"
        "from rdzv import progress\n"
        "progress()\n"
        "print(sorted(m for m in sys.modules if m.startswith('rdzv')))\n"
    )
    env = subprocess_env()
    env.pop(PROGRESS_DIR_VARIABLE, None)
    done = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    # Only the package and the worker module: nothing of the launcher or the store.
    assert done.stdout.strip() == "['rdzv', 'rdzv._lazy', 'rdzv.worker']"


def test_stack_report_keeps_the_dump_or_says_why_there_is_none() -> None:
    dump = b'noise\nFatal Python error: Aborted\n\nCurrent thread 0x1:\n  File "x.py", line 3\n'
    text = stack_report(1, 42, dump, "HEADER")
    assert text.startswith("HEADER\n\nFatal Python error: Aborted")
    assert "noise" not in text
    empty = stack_report(1, 42, b"", "HEADER")
    assert "no Python stack was captured from rank 1 (pid 42)" in empty
    other = stack_report(1, 42, b"bash: oops\n", "HEADER")
    assert "after the signal:\nbash: oops" in other


def test_a_watch_with_nothing_asked_changes_nothing(tmp_path: Path) -> None:
    watch = HangWatch(None, tmp_path, {}, print)
    with watch.serving():
        assert watch.begin(Path("run", "attempt_0")) == {}
        assert watch.check(WorkerGroup([], OutputSink(io.BytesIO(), io.BytesIO()))) is None


def test_the_timer_pipe_is_the_users_path_when_given_and_is_removed_after(
    tmp_path: Path,
) -> None:
    fifo = tmp_path / "my-timers"
    watch = HangWatch(None, None, {ENABLE_VARIABLE: "1", FILE_VARIABLE: str(fifo)}, print)
    with watch.serving():
        env = watch.begin(Path("run", "attempt_0"))
        assert env == {FILE_VARIABLE: str(fifo)}
        assert stat.S_ISFIFO(fifo.stat().st_mode)
    assert not fifo.exists()
    # Not "1": off, as torchrun reads it.
    assert HangWatch(None, None, {ENABLE_VARIABLE: "true"}, print).begin(Path("a")) == {}


# Each worker: call rdzv.progress() as the watch asks, say so, then get stuck.
STUCK = {
    "sleep": "import time\ndef stuck_in_sleep():\n    time.sleep(60)\nstuck_in_sleep()\n",
    "lock": (
        "import threading\ndef stuck_on_lock():\n    lock = threading.Lock()\n"
        "    lock.acquire()\n    lock.acquire(timeout=60)\nstuck_on_lock()\n"
    ),
    "c": "def stuck_in_c():\n    sum(range(10**11))\nstuck_in_c()\n",
}
PREAMBLE = "import rdzv\nrdzv.progress()\nprint('marked', flush=True)\n"


@pytest.fixture
def group() -> Iterator[list[WorkerGroup]]:
    groups: list[WorkerGroup] = []
    try:
        yield groups
    finally:
        for each in groups:
            each.stop(grace=0.0, signum=signal.SIGKILL)


def start_workers(
    watch: HangWatch, kinds: list[str], groups: list[WorkerGroup], out: io.BytesIO
) -> WorkerGroup:
    env = {**subprocess_env(), **watch.begin(Path("run", "attempt_0"))}
    specs = [
        WorkerSpec(
            rank, rank, [sys.executable, "-c", PREAMBLE + STUCK[kind]], {**env, "RANK": str(rank)}
        )
        for rank, kind in enumerate(kinds)
    ]
    workers = WorkerGroup(specs, OutputSink(out, out))
    groups.append(workers)
    workers.start()
    return workers


def test_a_silent_rank_is_judged_on_the_fake_clock_and_every_workers_stacks_are_kept(
    tmp_path: Path, group: list[WorkerGroup]
) -> None:
    clock = FakeClock()
    messages: list[str] = []
    watch = HangWatch(20.0, tmp_path, {}, messages.append, clock=clock)
    out = io.BytesIO()
    with watch.serving():
        workers = start_workers(watch, ["sleep", "lock", "c"], group, out)
        wait_until(lambda: out.getvalue().count(b"marked") == 3, "every worker's first mark", 30)
        assert watch.check(workers) is None  # the marks are seen now, at the fake clock's time
        clock.advance(20.0 + progress_every(20.0) - 0.01)
        assert watch.check(workers) is None
        assert len(workers.running()) == 3
        clock.advance(0.01)
        hung = watch.check(workers)
    assert isinstance(hung, WorkerExit)
    assert hung.rank == 0  # all silent since the same reading: the lowest rank is named
    directory = tmp_path / "run" / "attempt_0"
    assert hung.hang == (
        f" (no progress for 20 s); stacks in {directory / 'rank_0.stacks'} "
        "(and rank_1.stacks, rank_2.stacks beside it)"
    )
    assert hung.describe().startswith(f"rank 0 hung (no progress for 20 s); stacks in {directory}")
    assert workers.running() == {}
    for rank, function in enumerate(["stuck_in_sleep", "stuck_on_lock", "stuck_in_c"]):
        text = (directory / f"rank_{rank}.stacks").read_text()
        assert text.startswith(f"rdzv run: Python stacks of rank {rank} (pid ")
        assert "after rank 0 made no progress for 20 s" in text
        assert "Fatal Python error: Aborted" in text
        assert f"in {function}" in text, text
    assert "rank 0 made no progress for 20 s: writing the stacks" in messages[0]
    assert PROGRESS_DIR_VARIABLE not in os.environ  # the watch set the workers' env, not ours


def test_a_worker_that_never_called_progress_is_not_judged(
    tmp_path: Path, group: list[WorkerGroup]
) -> None:
    clock = FakeClock()
    watch = HangWatch(1.0, tmp_path, {}, print, clock=clock)
    out = io.BytesIO()
    with watch.serving():
        env = {**subprocess_env(), **watch.begin(Path("run", "attempt_0"))}
        code = "print('up', flush=True)\nimport time\ntime.sleep(60)\n"
        spec = WorkerSpec(0, 0, [sys.executable, "-c", code], {**env, "RANK": "0"})
        workers = WorkerGroup([spec], OutputSink(out, out))
        group.append(workers)
        workers.start()
        wait_until(lambda: b"up" in out.getvalue(), "the worker up", 30)
        for _ in range(5):
            assert watch.check(workers) is None
            clock.advance(100.0)
        assert workers.running() != {}


def test_without_a_log_dir_the_stacks_go_to_a_kept_directory(
    tmp_path: Path, group: list[WorkerGroup]
) -> None:
    clock = FakeClock()
    watch = HangWatch(5.0, None, {}, print, clock=clock)
    out = io.BytesIO()
    with watch.serving():
        workers = start_workers(watch, ["sleep"], group, out)
        wait_until(lambda: b"marked" in out.getvalue(), "the first mark", 30)
        watch.check(workers)
        clock.advance(10.0)
        hung = watch.check(workers)
    assert hung is not None
    assert hung.hang is not None
    path = Path(hung.hang.split("stacks in ")[1])
    try:
        assert path.name == "rank_0.stacks"
        assert path.parent.parts[-2:] == ("run", "attempt_0")
        assert "in stuck_in_sleep" in path.read_text()
    finally:
        shutil.rmtree(path.parents[2])
