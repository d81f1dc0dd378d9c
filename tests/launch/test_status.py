"""``rdzv status`` against a live run, and its formatting."""

from __future__ import annotations

import argparse
import io
import json
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from rdzv import HashStore
from rdzv.backends.base import GONE_MARK
from rdzv.backends.store import C10dRendezvousBackend
from rdzv.dynamic.state import RendezvousState, encode_state, node_address
from rdzv.first_failure import FailureRecord
from rdzv.keys import last_failure_key
from rdzv.status import HeartbeatTracker, MemberStatus, RunStatus, format_status, read_status
from rdzv.status_cli import EXIT_UNKNOWN_RUN, add_status_arguments, status_command
from tests.launch.procs import WORKER, agents, c10d_args, finish, with_world
from tests.procs import free_port, subprocess_env, wait_until


def status(endpoint: str, run_id: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "rdzv.cli",
            "status",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={run_id}",
            *extra,
        ],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def status_json(endpoint: str, run_id: str) -> dict[str, Any]:
    done = status(endpoint, run_id, "--json", "--sample=1")
    assert done.returncode == 0, done.stderr
    data: dict[str, Any] = json.loads(done.stdout)
    return data


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_status_of_a_live_run(endpoint: str, tmp_path: Path) -> None:
    args = [*c10d_args(endpoint, "1:2", "live"), WORKER, str(tmp_path), "wait-release"]
    with agents() as group:
        members = [group.start(args), group.start(args)]
        wait_until(lambda: len(with_world(tmp_path, 2)) == 2, what="a round of 2 nodes")
        running = status_json(endpoint, "live")
        assert running["complete"]
        assert not running["closed"]
        assert [m["rank"] for m in running["members"]] == [0, 1]
        assert all(m["address"] == "127.0.0.1" for m in running["members"])
        # heartbeats every 0.3 s: seen within the 1 s sample
        assert all(m["heartbeat_age"] is not None for m in running["members"])
        assert all(not m["evicted"] for m in running["members"])
        assert running["waiting"] == []
        # each agent reported its host, workers and restarts
        assert [m["workers"] for m in running["members"]] == [1, 1]
        assert [m["restarts"] for m in running["members"]] == [0, 0]
        assert all(m["host"] == socket.gethostname() for m in running["members"])
        # a third node queues for the next round: the wait list names it
        group.start(args)
        wait_until(
            lambda: len(status_json(endpoint, "live")["waiting"]) == 1,
            what="the third node on the wait list",
        )
        waiting = status_json(endpoint, "live")["waiting"]
        assert [node_address(w) for w in waiting] == ["127.0.0.1"]
        assert waiting[0].count("#") == 2
        table = status(endpoint, "live", "--sample=0.5").stdout
        assert f"run 'live': round {running['round']} complete, open" in table
        assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d run 'live'", table)
        assert "workers  restarts  host" in table
        assert f"waiting for round {running['round'] + 1}: {waiting[0]}" in table
        (tmp_path / "release-2").write_text("")
        assert [finish(p)[0] for p in members] == [0, 0]
        assert status_json(endpoint, "live")["closed"]


def test_status_of_an_unknown_backend_is_a_clear_error() -> None:
    done = status("127.0.0.1:1", "x", "--rdzv-backend=nosuch")
    assert done.returncode == 2
    assert "'nosuch' is not registered." in done.stderr
    assert "Known backends: c10d" in done.stderr


def test_status_of_an_unreachable_endpoint_fails_quickly() -> None:
    done = status(f"127.0.0.1:{free_port()}", "x", "--rdzv-conf=read_timeout=1")
    assert done.returncode == 3
    assert "rdzv status: cannot reach the backend" in done.stderr


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_heartbeat_age_is_measured_on_the_local_clock() -> None:
    clock = FakeClock()
    tracker = HeartbeatTracker(clock)
    tracker.observe("a", b"1")
    tracker.observe("b", b"7")
    clock.now += 1.0
    tracker.observe("a", b"2")
    tracker.observe("b", b"7")
    clock.now += 0.5
    assert tracker.age("a") == pytest.approx(0.5)
    assert tracker.age("b") is None
    assert tracker.observed_for == pytest.approx(1.5)
    assert not tracker.gone("a")
    tracker.observe("a", GONE_MARK)  # the store wrote a's will: its process died
    assert tracker.gone("a")


def test_format_status_table() -> None:
    run = RunStatus(
        "job",
        3,
        False,
        [
            MemberStatus(0, "10.0.0.1#1#a", "10.0.0.1", False, 0.25),
            MemberStatus(1, "10.0.0.2#1#b", "10.0.0.2", True, None),
            MemberStatus(2, "10.0.0.4#1#d", "10.0.0.4", False, 3.0, gone=True),
        ],
        ["10.0.0.3#7#c"],
        2.0,
    )
    text = format_status(run)
    assert text.splitlines() == [
        "run 'job': round 3 complete, open",
        "rank  node          state    heartbeat",
        "   0  10.0.0.1#1#a  member   0.2 s ago",
        "   1  10.0.0.2#1#b  evicted  none seen in 2.0 s",
        "   2  10.0.0.4#1#d  member   process gone",
        "waiting for round 4: 10.0.0.3#7#c",
    ]
    assert run.to_json()["complete"] is True
    assert "no round has completed yet" in format_status(RunStatus("job", -1, False))


def test_format_status_with_agent_reports_and_a_timestamp() -> None:
    when = time.mktime((2030, 1, 31, 12, 0, 0, 0, 0, -1))
    run = RunStatus(
        "job",
        0,
        True,
        [MemberStatus(0, "10.0.0.1#1#a", "10.0.0.1", False, 1.0, "gpu01", 8, 2)],
        [],
        2.0,
        when,
    )
    assert format_status(run).splitlines() == [
        "2030-01-31 12:00:00 run 'job': round 0 complete, closed",
        "rank  node          state   heartbeat  workers  restarts  host",
        "   0  10.0.0.1#1#a  member  1.0 s ago  8        2         gpu01",
        "waiting for round 1: none",
    ]


def test_format_status_escapes_control_characters_read_from_the_store() -> None:
    run = RunStatus(
        "job\x1b[2J",
        0,
        False,
        [MemberStatus(0, "10.0.0.1#1#a", "10.0.0.1", False, 1.0, "evil\x1b]0;x\x07", 1, 0)],
        ["10.0.0.3#7#\x9b"],
    )
    text = format_status(run)
    assert "\x1b" not in text
    assert "\x07" not in text
    assert "\x9b" not in text
    assert "evil\\x1b]0;x\\x07" in text


def test_format_status_names_the_first_failure_or_why_it_was_ignored() -> None:
    when = time.mktime((2030, 1, 31, 12, 3, 4, 0, 0, -1))
    failure = FailureRecord(
        "signal", 3, 1, "host-b", when, signal="SIGKILL", log="/l/rank_3.log", round=2, restart=1
    )
    run = RunStatus("job", 3, False, first_failure=failure)
    assert format_status(run).splitlines()[-1] == (
        "first failure: worker rank 3 on host-b (local rank 1) was killed by signal SIGKILL "
        "at 12:03:04 (round 2, restart 1); log: /l/rank_3.log"
    )
    assert run.to_json()["first_failure"]["signal"] == "SIGKILL"
    noted = RunStatus("job", 3, False, failure_note="it does not decode (\x1b[2J)")
    assert format_status(noted).splitlines()[-1] == "first failure: it does not decode (\\x1b[2J)"
    assert format_status(RunStatus("job", 3, False)).splitlines()[-1].startswith("waiting")


def test_a_stored_failure_that_does_not_decode_is_a_note_not_an_error() -> None:
    store = HashStore()
    backend = C10dRendezvousBackend(store, "job")
    backend.set_state(encode_state(RendezvousState(0, ("10.0.0.1#1#a",))))
    store.set(last_failure_key("job"), b'{"v": 1, "kind": "signal"}')
    read = read_status(backend, "job", HeartbeatTracker(), store=store)
    assert read.first_failure is None
    assert read.failure_note == (
        "the stored record does not decode and was ignored (rank is missing)"
    )
    assert "first failure: the stored record does not decode" in format_status(read)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_status_before_the_first_round_and_of_an_unknown_run(endpoint: str, tmp_path: Path) -> None:
    args = [*c10d_args(endpoint, "2", "early"), WORKER, str(tmp_path), "wait-release"]
    with agents() as group:
        group.start(args)  # one of two nodes: it queues for round 0
        wait_until(
            lambda: status(endpoint, "early", "--sample=0").returncode == 0,
            what="the node queued for round 0",
        )
        early = status_json(endpoint, "early")
        assert early["round"] == -1
        assert early["known"]
        table = status(endpoint, "early", "--sample=0").stdout
        assert "no round has completed yet" in table
        assert f"waiting for round 0: {early['waiting'][0]}" in table
        typo = status(endpoint, "eraly", "--sample=0")
        assert typo.returncode == EXIT_UNKNOWN_RUN
        assert "run 'eraly' is unknown to the backend: runs there: 'early'" in typo.stderr
        listed = status(endpoint, "", "--list-runs")
        assert listed.returncode == 0, listed.stderr
        assert listed.stdout.splitlines() == ["early: no round yet, open, 0 member(s), 1 waiting"]
        listed_json = json.loads(status(endpoint, "", "--list-runs", "--json").stdout)
        assert listed_json == [
            {"closed": False, "members": 0, "round": -1, "run_id": "early", "waiting": 1}
        ]


def test_status_needs_a_run_id_or_list_runs() -> None:
    done = status("127.0.0.1:1", "")
    assert done.returncode == 2
    assert "--rdzv-id is required (or --list-runs)" in done.stderr


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_watch_redraws_in_place_and_says_when_the_job_finished(
    endpoint: str, tmp_path: Path
) -> None:
    args = [*c10d_args(endpoint, "1", "watched"), WORKER, str(tmp_path), "wait-release"]
    with agents() as group:
        agent = group.start(args)
        wait_until(lambda: len(with_world(tmp_path, 1)) == 1, what="the round of 1 node")
        parser = argparse.ArgumentParser()
        add_status_arguments(parser)
        options = parser.parse_args(
            [f"--rdzv-endpoint={endpoint}", "--rdzv-id=watched", "--watch=0.3"]
        )
        screen = _Terminal()
        outcome: list[int] = []
        watcher = threading.Thread(
            target=lambda: outcome.append(status_command(options, screen)), daemon=True
        )
        watcher.start()
        wait_until(lambda: screen.getvalue().count("\x1b[H\x1b[J") >= 2, what="two redraws")
        (tmp_path / "release-1").write_text("")
        assert finish(agent)[0] == 0
        watcher.join(timeout=30)
    assert outcome == [0]
    shown = screen.getvalue()
    assert shown.rstrip().endswith("run 'watched': job finished (the run is closed)")
    assert "round 0 complete, closed" in shown
