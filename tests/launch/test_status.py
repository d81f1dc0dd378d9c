"""``rdzv status`` against a live run, and its formatting."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rdzv.status import HeartbeatTracker, MemberStatus, RunStatus, format_status
from tests.launch.procs import WORKER, agents, c10d_args, finish, wait_for, with_world
from tests.procs import free_port, subprocess_env


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
        wait_for(lambda: len(with_world(tmp_path, 2)) == 2, what="a round of 2 nodes")
        running = status_json(endpoint, "live")
        assert running["complete"]
        assert not running["closed"]
        assert [m["rank"] for m in running["members"]] == [0, 1]
        assert all(m["address"] == "127.0.0.1" for m in running["members"])
        # heartbeats every 0.3 s: seen within the 1 s sample
        assert all(m["heartbeat_age"] is not None for m in running["members"])
        assert all(not m["evicted"] for m in running["members"])
        assert running["waiting"] == []
        # a third node queues for the next round: the wait list shows it
        group.start(args)
        wait_for(
            lambda: status_json(endpoint, "live")["waiting"] == ["127.0.0.1"],
            what="the third node on the wait list",
        )
        table = status(endpoint, "live", "--sample=0.5").stdout
        assert f"run 'live': round {running['round']} complete, open" in table
        assert "waiting for round" in table
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


def test_format_status_table() -> None:
    run = RunStatus(
        "job",
        3,
        False,
        [
            MemberStatus(0, "10.0.0.1#1#a", "10.0.0.1", False, 0.25),
            MemberStatus(1, "10.0.0.2#1#b", "10.0.0.2", True, None),
        ],
        ["10.0.0.3"],
        2.0,
    )
    text = format_status(run)
    assert text.splitlines() == [
        "run 'job': round 3 complete, open",
        "rank  node          state    heartbeat",
        "   0  10.0.0.1#1#a  member   0.2 s ago",
        "   1  10.0.0.2#1#b  evicted  none seen in 2.0 s",
        "waiting for round 4: 10.0.0.3",
    ]
    assert run.to_json()["complete"] is True
    assert "no round has completed yet" in format_status(RunStatus("job", -1, False))
