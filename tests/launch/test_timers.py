"""torch's expiration timers under ``rdzv run``: parsing, decisions on a fake wall clock, the pipe.

The decisions (:class:`TimerTable`) run on wall-clock times handed in; the
server (:class:`FileTimerServer`) reads a real named pipe and compares on an
injected wall clock, and its pids are real processes.
"""

from __future__ import annotations

import json
import os
import select
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rdzv.launch.timers import (
    MAX_TIMERS,
    Expiry,
    FileTimerServer,
    TimerRequest,
    TimerTable,
    owner_of,
    parse_request,
)
from tests.procs import Children, wait_until

pytestmark = pytest.mark.timeout(60)


def line(pid: int, scope: str, expiration: float, signum: int = 9) -> bytes:
    """A request as torch's ``FileTimerRequest.to_json`` writes it."""
    return json.dumps(
        {
            "version": 1,
            "pid": pid,
            "scope_id": scope,
            "expiration_time": expiration,
            "signal": signum,
        }
    ).encode()


def test_parse_request_reads_torchs_format() -> None:
    assert parse_request(line(42, "step", 1000.5)) == TimerRequest(42, "step", 1000.5, 9)
    release = parse_request(line(42, "step", -1, 0))
    assert release.release
    assert not parse_request(line(42, "step", 0)).release


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"[1, 2]",
        b'"a string"',
        b"\xff\xfe",
        b"[" * 5000,
        b"{" + b'"a": 1, ' * 600 + b'"b": 2}',
        json.dumps({"pid": 1, "scope_id": "s", "expiration_time": 1}).encode(),
        line(0, "s", 1),
        line(-5, "s", 1),
        json.dumps({"pid": True, "scope_id": "s", "expiration_time": 1, "signal": 9}).encode(),
        json.dumps({"pid": 1, "scope_id": 3, "expiration_time": 1, "signal": 9}).encode(),
        json.dumps({"pid": 1, "scope_id": "s", "expiration_time": "1", "signal": 9}).encode(),
        json.dumps({"pid": 1, "scope_id": "s", "expiration_time": True, "signal": 9}).encode(),
        json.dumps({"pid": 1, "scope_id": "s", "expiration_time": 1, "signal": 9.0}).encode(),
        b'{"pid": 1, "scope_id": "s", "expiration_time": NaN, "signal": 9}',
        b'{"pid": 1, "scope_id": "s", "expiration_time": Infinity, "signal": 9}',
    ],
)
def test_parse_request_rejects_garbage_with_value_error(raw: bytes) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - any message; the type is the contract
        parse_request(raw)


def test_a_timer_is_due_once_its_wall_clock_expiration_passed() -> None:
    table = TimerTable()
    assert table.apply(parse_request(line(7, "step", 1010.0)), received=1000.0)
    assert table.due(1009.999) == []
    assert table.due(1010.0) == [Expiry(7, "step", 10.0, 9)]
    assert table.due(2000.0) == []  # taken out once


def test_a_released_timer_never_expires_and_a_reacquired_one_moves() -> None:
    table = TimerTable()
    table.apply(parse_request(line(7, "step", 1010.0)), 1000.0)
    table.apply(parse_request(line(7, "step", -1, 0)), 1001.0)
    assert table.due(5000.0) == []
    table.apply(parse_request(line(7, "step", 1010.0)), 1000.0)
    table.apply(parse_request(line(7, "step", 1030.0)), 1020.0)
    assert table.due(1025.0) == []
    assert table.due(1030.0) == [Expiry(7, "step", 10.0, 9)]


def test_due_timers_come_earliest_first_and_scopes_of_one_pid_are_separate() -> None:
    table = TimerTable()
    table.apply(parse_request(line(1, "late", 1020.0)), 1000.0)
    table.apply(parse_request(line(2, "early", 1005.0, 15)), 1000.0)
    table.apply(parse_request(line(1, "other", 1010.0)), 1000.0)
    table.apply(parse_request(line(1, "other", -1, 0)), 1001.0)
    assert [(e.pid, e.scope, e.signum) for e in table.due(1030.0)] == [
        (2, "early", 15),
        (1, "late", 9),
    ]


def test_the_table_holds_a_bounded_number_of_timers() -> None:
    table = TimerTable(limit=2)
    assert table.apply(parse_request(line(1, "a", 10.0)), 0.0)
    assert table.apply(parse_request(line(1, "b", 10.0)), 0.0)
    assert not table.apply(parse_request(line(1, "c", 10.0)), 0.0)
    assert table.apply(parse_request(line(1, "a", 20.0)), 0.0)  # a held one may move
    assert table.apply(parse_request(line(1, "a", -1, 0)), 0.0)
    assert table.apply(parse_request(line(1, "c", 10.0)), 0.0)
    assert len(table) == 2
    assert MAX_TIMERS >= 1000


class WallClock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def send(path: Path, raw: bytes) -> None:
    """Write one request as torch's client does: non-blocking open, one atomic write."""
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    try:
        os.write(fd, raw + b"\n")
    finally:
        os.close(fd)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[FileTimerServer, WallClock, list[str]]]:
    clock = WallClock()
    messages: list[str] = []
    served = FileTimerServer(tmp_path / "timers", messages.append, clock)
    served.open()
    try:
        yield served, clock, messages
    finally:
        served.close()


@pytest.fixture
def children() -> Iterator[Children]:
    group = Children(new_session=True)
    try:
        yield group
    finally:
        group.stop()


def settle(
    served: FileTimerServer, clock: WallClock, messages: list[str], pid: int, rank: int
) -> None:
    """Wait until every request sent so far was read (at ``clock.now``): a marker's report.

    The marker is a timer of ``pid`` (a worker of rank ``rank``) due at
    once with no signal, so it is only reported.
    """
    count = len(messages)
    send(served.path, line(pid, "marker", clock.now, 0))
    owner = owner_of({rank: pid})
    wait_until(lambda: served.check(owner) is None and len(messages) > count, "the marker", 10)
    assert "'marker' expired" in messages[-1]


def sleeper(children: Children) -> subprocess.Popen[bytes]:
    return children.popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_an_expired_timer_kills_its_worker_with_the_requested_signal(
    server: tuple[FileTimerServer, WallClock, list[str]], children: Children
) -> None:
    served, clock, messages = server
    worker = sleeper(children)
    owner = owner_of({3: worker.pid})
    assert stat.S_ISFIFO(served.path.stat().st_mode)
    send(served.path, line(worker.pid, "step", clock.now + 2.0))
    send(served.path, line(worker.pid, "quick", clock.now + 1.0))
    send(served.path, line(worker.pid, "quick", -1, 0))
    settle(served, clock, messages, worker.pid, 3)
    clock.now += 1.5
    assert served.check(owner) is None
    clock.now += 0.5
    found = wait_until(lambda: served.check(owner), "the expired timer acted on", 10)
    assert found == (3, Expiry(worker.pid, "step", 2.0, 9))
    assert worker.wait(timeout=10) == -signal.SIGKILL
    assert served.check(owner) is None


def test_a_timer_of_a_workers_child_names_the_worker(
    server: tuple[FileTimerServer, WallClock, list[str]], children: Children
) -> None:
    served, clock, _ = server
    code = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    worker = children.popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert worker.stdout is not None
    child = int(worker.stdout.readline())
    send(served.path, line(child, "data", clock.now, int(signal.SIGTERM)))
    found = wait_until(lambda: served.check(owner_of({5: worker.pid})), "the child's timer", 10)
    assert found == (5, Expiry(child, "data", 0.0, int(signal.SIGTERM)))
    wait_until(lambda: not Path(f"/proc/{child}").exists() or _zombie(child), "child killed")
    assert worker.poll() is None  # only the pid that asked is signalled, as under torchrun


def _zombie(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_timers_of_other_processes_and_without_a_signal_are_reported_not_acted_on(
    server: tuple[FileTimerServer, WallClock, list[str]], children: Children
) -> None:
    served, clock, messages = server
    worker = sleeper(children)
    owner = owner_of({0: worker.pid})
    send(served.path, line(os.getpid(), "foreign", clock.now))
    send(served.path, line(worker.pid, "gentle", clock.now, 0))
    wait_until(lambda: served.check(owner) is None and len(messages) >= 2, "both reported", 10)
    assert "'foreign' of pid" in messages[0]
    assert "not a worker of this node" in messages[0]
    assert "rank 0's expiration timer 'gentle' expired" in messages[1]
    assert "left running" in messages[1]
    assert worker.poll() is None


def test_garbage_on_the_pipe_is_reported_once_and_later_requests_still_work(
    server: tuple[FileTimerServer, WallClock, list[str]], children: Children
) -> None:
    served, clock, messages = server
    worker = sleeper(children)
    send(served.path, b"garbage")
    send(served.path, b"x" * (select.PIPE_BUF - 1))
    send(served.path, line(worker.pid, "step", clock.now))
    found = wait_until(lambda: served.check(owner_of({1: worker.pid})), "the timer", 10)
    assert found is not None
    assert found[1].scope == "step"
    assert len(messages) == 1
    assert "ignored a bad expiration timer request" in messages[0]
    assert "b'garbage'" in messages[0]


def test_reset_forgets_the_timers_of_the_last_attempt(
    server: tuple[FileTimerServer, WallClock, list[str]], children: Children
) -> None:
    served, clock, messages = server
    worker = sleeper(children)
    owner = owner_of({0: worker.pid})
    send(served.path, line(worker.pid, "old", clock.now + 1))
    settle(served, clock, messages, worker.pid, 0)
    served.reset()
    clock.now += 10
    assert served.check(owner) is None
    assert worker.poll() is None


def test_the_pipe_replaces_a_stale_file_and_is_removed_at_close(tmp_path: Path) -> None:
    path = tmp_path / "timers"
    path.write_text("stale")
    served = FileTimerServer(path, print)
    served.open()
    assert stat.S_ISFIFO(path.stat().st_mode)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    served.close()
    assert not path.exists()


def test_a_pipe_that_cannot_be_created_is_an_os_error(tmp_path: Path) -> None:
    served = FileTimerServer(tmp_path / "no" / "such" / "dir" / "timers", print)
    with pytest.raises(OSError):  # noqa: PT011 - the caller reports whichever it is
        served.open()


@pytest.mark.slow
@pytest.mark.torch
def test_torchs_file_timer_client_in_a_worker_talks_to_the_server(
    server: tuple[FileTimerServer, WallClock, list[str]], children: Children
) -> None:
    served, clock, messages = server
    code = (
        "import sys, time\n"
        "from torch.distributed.elastic.timer import FileTimerClient\n"
        "client = FileTimerClient(sys.argv[1])\n"
        "now = float(sys.argv[2])\n"
        "client.acquire('quick', now + 1)\n"
        "client.release('quick')\n"
        "client.acquire('step', now + 5)\n"
        "print('sent', flush=True)\n"
        "time.sleep(60)\n"
    )
    worker = children.popen(
        [sys.executable, "-c", code, str(served.path), repr(clock.now)], stdout=subprocess.PIPE
    )
    assert worker.stdout is not None
    assert worker.stdout.readline() == b"sent\n"
    owner = owner_of({2: worker.pid})
    settle(served, clock, messages, worker.pid, 2)
    clock.now += 4.9
    assert served.check(owner) is None
    clock.now += 0.1
    found = wait_until(lambda: served.check(owner), "the worker's timer", 10)
    assert found == (2, Expiry(worker.pid, "step", 5.0, int(signal.SIGKILL)))
    assert worker.wait(timeout=10) == -signal.SIGKILL
