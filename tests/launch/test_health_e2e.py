"""Real ``rdzv run`` agents with ``--health-check``: a failing node stays out, then gets in."""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

import pytest

from tests.launch.procs import WORKER, agents, c10d_args, finish, with_world
from tests.launch.test_status import status
from tests.procs import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

SICK = "echo 'nvml: GPU 0 is lost' >&2; exit 3"


def test_a_failing_health_check_keeps_the_node_out_and_status_shows_why(
    endpoint: str, tmp_path: Path
) -> None:
    args = c10d_args(endpoint, "1:2", "health")
    work = [WORKER, str(tmp_path), "wait-release"]
    sick_log = tmp_path / "sick.log"
    with agents() as group:
        healthy = group.start([*args, "--health-check=true", *work])
        sick = group.start(
            [
                *args,
                "--local-addr=127.0.0.2",
                f"--health-check={SICK}",
                "--exclude-after=2",
                "--exclude-cooldown=600",
                *work,
            ],
            stderr_path=sick_log,
        )
        wait_until(
            lambda: "is excluded from run" in sick_log.read_text(),
            what="the sick node excluded",
            broken=lambda: sick.poll() is not None,
            detail=sick_log.read_text,
        )
        log = sick_log.read_text()
        assert (
            f"health check {SICK!r} exited with code 3; stderr: nvml: GPU 0 is lost: this node "
            "stays out of the round (1 failure(s) in a row); checking again in 1 s"
        ) in log
        assert re.search(
            r"node 127\.0\.0\.2 is excluded from run 'health' for 600 s after 2 failure\(s\) in "
            r"a row \(exclusion 1; the next is twice as long\): health check .* exited with "
            r"code 3; stderr: nvml: GPU 0 is lost",
            log,
        )
        # the healthy node formed the round alone: the sick one never joined
        wait_until(lambda: with_world(tmp_path, 1), what="a round of the healthy node alone")
        assert not with_world(tmp_path, 2)
        shown = status(endpoint, "health", "--sample=0").stdout
        assert re.search(
            r"node 127\.0\.0\.2 excluded until \d\d:\d\d:\d\d \(\d+ s left of 600 s, "
            r"exclusion 1\): health check .* exited with code 3; stderr: nvml: GPU 0 is lost",
            shown,
        ), shown
        data = json.loads(status(endpoint, "health", "--json", "--sample=0").stdout)
        assert [(e["node"], e["exclusions"]) for e in data["excluded"]] == [("127.0.0.2", 1)]
        (tmp_path / "release-1").write_text("")
        assert finish(healthy)[0] == 0
        # the closed run ends the excluded node's wait (it looks every 5 s)
        code, _, _ = finish(sick)
        assert code == 3
        assert "the rendezvous of run 'health' is closed" in sick_log.read_text()


def test_a_check_that_fails_then_passes_lets_the_node_in(endpoint: str, tmp_path: Path) -> None:
    flag = tmp_path / "warmed-up"
    check = f"test -e {flag} || {{ touch {flag}; echo 'still warming up' >&2; exit 1; }}"
    args = [*c10d_args(endpoint, "1", "recovers"), f"--health-check={check}"]
    with agents() as group:
        node = group.start([*args, WORKER, str(tmp_path), "ok"])
        code, _, err = finish(node)
    assert code == 0, err
    assert (
        f"health check {check!r} exited with code 1; stderr: still warming up: this node "
        "stays out of the round (1 failure(s) in a row); checking again in 1 s"
    ) in err
    assert f"health check {check!r} exited with code 0: this node may join again" in err
    assert len(with_world(tmp_path, 1)) == 1


def test_a_node_whose_workers_fail_is_excluded_when_asked(endpoint: str, tmp_path: Path) -> None:
    args = [
        *c10d_args(endpoint, "1", "workers"),
        "--max-restarts=1",
        "--exclude-after=1",
        "--exclude-cooldown=2",
    ]
    with agents() as group:
        node = group.start([*args, WORKER, str(tmp_path), "fail-once", "0", "7"])
        code, _, err = finish(node)
    assert code == 0, err
    assert re.search(
        r"node 127\.0\.0\.1 is excluded from run 'workers' for 2 s after 1 failure\(s\) in a row "
        r"\(exclusion 1; the next is twice as long\): worker rank 0 .*exited with code 7",
        err,
    ), err
    # it sat out the cool-down, then joined again and the restarted worker succeeded
    assert "restarting the group (restart 1/1)" in err
    assert len(with_world(tmp_path, 1)) == 2
    excluded_at = stamp(err, "is excluded from run")
    assert stamp(err, "starting workers 0-0 of 1 (restart 1/1") - excluded_at >= 2.0


def stamp(log: str, text: str) -> float:
    """Return the time stamp of the agent's line containing ``text``, in seconds."""
    line = next(line for line in log.splitlines() if text in line)
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S.%f").timestamp()
