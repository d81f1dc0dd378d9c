"""Health before admission: the agent's gate on a fake clock, and the check as a real process."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rdzv.cli import main
from rdzv.errors import RendezvousConnectionError
from rdzv.exclusion import KIND_WORKERS, ExclusionPolicy, ExclusionRecord, read_record
from rdzv.launch import AgentConfig
from rdzv.launch.health import HealthCheck, HealthCheckResult, NodeHealth
from rdzv.store.base import Value
from rdzv.store.memory import HashStore
from rdzv.testing import FakeClock
from tests.launch.procs import WORKER, alive
from tests.procs import wait_until

FAIL = HealthCheckResult("probe", 3, "gpu 0 lost")
PASS = HealthCheckResult("probe", 0)
OFF = ExclusionPolicy()


class Script:
    """A health check that answers from a list and notes the clock at each run."""

    def __init__(self, clock: FakeClock, results: list[HealthCheckResult]) -> None:
        self.clock = clock
        self.results = iter(results)
        self.ran_at: list[float] = []

    def __call__(self) -> HealthCheckResult:
        self.ran_at.append(self.clock())
        return next(self.results)


def gate(
    clock: FakeClock,
    check: Script | None,
    policy: ExclusionPolicy = OFF,
    store: HashStore | None = None,
    closed: Iterator[bool] | None = None,
) -> tuple[NodeHealth, list[str]]:
    lines: list[str] = []
    health = NodeHealth(
        "10.0.0.7",
        "job",
        policy,
        check,
        store,
        lines.append,
        (lambda: next(closed)) if closed is not None else (lambda: False),
        clock,
    )
    return health, lines


def test_a_failing_check_keeps_the_node_out_until_it_passes() -> None:
    clock = FakeClock()
    check = Script(clock, [FAIL, FAIL, PASS])
    health, lines = gate(clock, check)
    health.before_join()
    # retried after a back-off that doubles: 1 s, then 2 s
    assert [t - 1000.0 for t in check.ran_at] == [0.0, 1.0, 3.0]
    assert lines[0] == (
        "health check 'probe' exited with code 3; stderr: gpu 0 lost: this node stays out of "
        "the round (1 failure(s) in a row); checking again in 1 s"
    )
    assert "(2 failure(s) in a row); checking again in 2 s" in lines[1]
    assert lines[2] == "health check 'probe' exited with code 0: this node may join again"
    assert health.record.failures == 0


def test_k_failed_checks_exclude_the_node_for_a_cooldown_kept_in_the_store() -> None:
    clock, store = FakeClock(), HashStore()
    check = Script(clock, [FAIL, FAIL, FAIL, PASS])
    health, lines = gate(clock, check, ExclusionPolicy(after=3, cooldown=10.0), store)
    health.before_join()
    # 1 s and 2 s of back-off, then the 10 s cool-down, then the check passes
    assert [t - 1000.0 for t in check.ran_at] == [0.0, 1.0, 3.0, 13.0]
    assert lines[2].startswith(
        "node 10.0.0.7 is excluded from run 'job' for 10 s after 3 failure(s) in a row "
        "(exclusion 1; the next is twice as long): health check 'probe' exited with code 3"
    )
    stored = read_record(store, "job", "10.0.0.7")
    assert stored is not None
    assert (stored.exclusions, stored.cooldown, stored.until) == (1, 10.0, 1013.0)


def test_worker_failures_count_only_when_exclusion_is_on() -> None:
    clock = FakeClock()
    health, lines = gate(clock, None)
    assert not health.active
    for _ in range(5):
        health.attempt_ended("worker rank 0 exited with code 1")
    health.before_join()
    assert clock() == 1000.0
    assert health.record == ExclusionRecord("10.0.0.7")
    assert lines == []


def test_k_worker_failures_in_a_row_keep_the_agent_from_joining() -> None:
    clock = FakeClock()
    health, lines = gate(clock, None, ExclusionPolicy(after=2, cooldown=30.0))
    health.attempt_ended("worker rank 0 exited with code 1")
    health.attempt_ended(None)  # a re-form: the count starts again
    health.attempt_ended("worker rank 0 exited with code 1")
    health.before_join()
    assert clock() == 1000.0
    health.attempt_ended("worker rank 0 exited with code 1")
    assert health.record.kind == KIND_WORKERS
    health.before_join()
    assert clock() == 1030.0
    assert "for 30 s after 2 failure(s) in a row" in lines[0]
    # the next exclusion is twice as long
    health.attempt_ended("again")
    health.attempt_ended("again")
    health.before_join()
    assert clock() == 1090.0


def test_a_new_agent_of_the_node_honours_the_stored_exclusion() -> None:
    clock, store = FakeClock(), HashStore()
    first, _ = gate(clock, None, ExclusionPolicy(after=1, cooldown=50.0), store)
    first.attempt_ended("worker rank 0 exited with code 1")
    clock.advance(20.0)
    second, lines = gate(clock, None, ExclusionPolicy(after=1, cooldown=50.0), store)
    second.before_join()
    assert clock() == 1050.0
    assert lines[0].startswith("this node is still excluded: 10.0.0.7 excluded until ")


def test_a_closed_run_ends_the_wait() -> None:
    clock = FakeClock()
    check = Script(clock, [FAIL, FAIL])
    # open for the first check and its back-off, then closed
    health, _ = gate(clock, check, closed=iter([False, False, False, True, True]))
    health.before_join()
    assert len(check.ran_at) == 1
    assert clock() == 1001.0


class BrokenStore(HashStore):
    def set(self, key: str, value: Value) -> None:
        raise RendezvousConnectionError("store down")


def test_a_store_that_fails_costs_a_line_and_the_record_lives_on() -> None:
    clock = FakeClock()
    health, lines = gate(clock, None, ExclusionPolicy(after=1, cooldown=5.0), BrokenStore())
    health.attempt_ended("worker failed")
    assert lines[0] == (
        "could not write this node's exclusion record: RendezvousConnectionError: store down"
    )
    health.before_join()
    assert clock() == 1005.0


def test_the_check_runs_as_a_process_and_reports_its_status_and_stderr_tail() -> None:
    result = HealthCheck("echo starting; echo 'nvml: GPU 0 fell off the bus' >&2; exit 3")()
    assert result.returncode == 3
    assert result.describe() == (
        "health check \"echo starting; echo 'nvml: GPU 0 fell off the bus' >&2; exit 3\" "
        "exited with code 3; stderr: nvml: GPU 0 fell off the bus"
    )
    assert HealthCheck("true")().ok
    long = HealthCheck("yes error | head -c 100000 >&2; exit 1")()
    assert long.stderr.startswith("...")
    assert len(long.stderr) < 400


@pytest.mark.timeout(30)
def test_a_check_that_times_out_is_killed_with_its_children(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    command = f"sleep 60 & echo $! > {pid_file}; wait"
    started = time.monotonic()
    result = HealthCheck(command, timeout=0.5)()
    assert result.returncode is None
    assert result.describe() == f"health check {command!r} timed out after 0.5 s"
    assert time.monotonic() - started < 20  # a generous bound that only catches a hang
    child = int(pid_file.read_text())
    wait_until(lambda: not alive(child), what="the check's background child killed", timeout=10)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--health-check", " "], "--health-check is empty; give a command"),
        (["--health-check", "true", "--health-check-timeout", "0"], "--health-check-timeout 0"),
        (["--health-check-timeout", "inf"], "--health-check-timeout inf must be positive"),
        (["--exclude-after", "-1"], "--exclude-after -1 must be 0 (off) or more"),
        (["--exclude-cooldown", "0"], "--exclude-cooldown 0 must be positive seconds"),
        (["--exclude-cooldown", "1e9"], "--exclude-cooldown 1e+09 must be positive seconds up to"),
    ],
)
def test_bad_health_options_exit_2_naming_the_option(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", "--standalone", *argv, WORKER]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rdzv run: error:")
    assert message in err
    assert len(err.splitlines()) == 1


def test_agent_config_refuses_bad_health_settings() -> None:
    with pytest.raises(ValueError, match="health_check is an empty command"):
        AgentConfig(entrypoint=["x.py"], health_check="")
    with pytest.raises(ValueError, match="health_check_timeout"):
        AgentConfig(entrypoint=["x.py"], health_check_timeout=-1.0)
