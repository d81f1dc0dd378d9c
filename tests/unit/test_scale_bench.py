"""The scale benchmark's own harness: its process layout, its line reader, one small run."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPT = BENCHMARKS / "scale_bench.py"


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    sys.path.insert(0, str(BENCHMARKS))  # its `_common` sits beside it
    try:
        spec = importlib.util.spec_from_file_location("scale_bench", SCRIPT)
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.mark.parametrize(
    ("cores", "n", "expected"),
    [(2, 100, 128), (2, 2048, 128), (2, 2049, 129), (2, 8192, 512), (4, 8192, 256), (1, 2048, 256)],
)
def test_a_core_runs_at_most_eight_agent_processes_of_at_least_128(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch, cores: int, n: int, expected: int
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    per_process = bench.agents_per_process(n)
    assert per_process == expected
    processes = -(-n // per_process)
    assert processes <= 8 * cores or per_process == bench.MIN_PER_PROCESS


@contextlib.contextmanager
def _writer(code: str) -> Iterator[subprocess.Popen[str]]:
    """A child that runs ``code`` (which writes to stdout and then waits on stdin), killed by pid."""
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=30)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()


def test_two_lines_written_at_once_are_both_read(bench: ModuleType) -> None:
    # Both lines go in one write: a reader that selects on the text stream
    # finds the second in its own buffer only, and waits out its deadline.
    code = "import sys; sys.stdout.write('one\\ntwo\\n'); sys.stdout.flush(); sys.stdin.read()"
    with _writer(code) as proc:
        deadline = time.monotonic() + 30
        assert bench._readline(proc, deadline) == "one\n"
        assert bench._readline(proc, deadline) == "two\n"
        assert proc.stdin is not None
        proc.stdin.close()
        assert bench._readline(proc, deadline) == ""  # its end


def test_a_line_that_does_not_come_by_the_deadline_is_empty(bench: ModuleType) -> None:
    with _writer(
        "import sys; sys.stdout.write('part'); sys.stdout.flush(); sys.stdin.read()"
    ) as proc:
        assert bench._readline(proc, time.monotonic() + 0.5) == ""
        assert proc.stdin is not None
        proc.stdin.close()
        # What came before the end is the last line.
        assert bench._readline(proc, time.monotonic() + 30) == "part"


def _run_small(backends: str, scenarios: str, *extra: str) -> list[str]:
    """Run the benchmark at N = 8 (4 agents a process); return its result rows."""
    argv = [sys.executable, str(SCRIPT), "--n", "8", "--backends", backends]
    argv += ["--scenarios", scenarios, "--per-proc", "4", "--join", "60", *extra]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line for line in result.stdout.splitlines() if " N=8 " in line]
    assert all("FAILED" not in row for row in rows), result.stdout
    return rows


@pytest.mark.slow
def test_a_small_formation_and_recovery_run_and_count_no_false_death() -> None:
    rows = _run_small("rdzv", "formation,recovery")
    assert [row.split()[0] for row in rows] == ["formation", "recovery"], rows
    for row in rows:
        assert "false 0" in row
    assert "dead 1 false 0" in rows[1]  # the killed agent, judged


@pytest.mark.slow
def test_the_floor_columns_form_with_rdzvs_messages_and_without_the_confirmation() -> None:
    lines = _run_small("floor,floor-noconfirm", "formation,lastcall,recovery", "--last-call", "0.2")
    rows = [line.split(" | ") for line in lines]
    # Recovery needs a handler: the floors run one round of a whole group only.
    assert [row[0].split()[:2] for row in rows] == [
        ["formation", "floor"],
        ["formation", "floor-noconfirm"],
        ["lastcall", "floor"],
        ["lastcall", "floor-noconfirm"],
    ], lines
    fields = [dict(field.split(" ", 1) for field in row[1:]) for row in rows]
    # A member's messages: the head, a join's append and add, the seal's
    # wait, and (with the confirmation) an append, an add and the verdict's
    # wait; the sealer reads the count and writes the seal, the last to
    # confirm writes the verdict. The last call's round has N/2 members.
    expected = [7 + 3 / 8, 4 + 2 / 8, 7 + 3 / 4, 4 + 2 / 4]
    requests = [float(f["req/agent"]) for f in fields]
    assert requests == pytest.approx(expected, abs=0.01), lines
    for f in fields[2:]:
        assert float(f["overhead"].removesuffix("s")) >= 0, f  # the last call was waited out


@pytest.mark.slow
@pytest.mark.etcd
@pytest.mark.redis
def test_the_engine_floors_form_and_rdzv_is_printed_over_its_floor() -> None:
    lines = _run_small("etcd,etcd-floor,redis-floor-noconfirm", "formation", "--etcd-members", "3")
    assert [line.split()[:2] for line in lines] == [
        ["formation", "etcd"],
        ["formation", "etcd-floor"],
        ["formation", "redis-floor-noconfirm"],
        # The ratios after the table: etcd over its floor, nothing over a floor.
        ["formation", "etcd"],
    ], lines
    assert " over etcd-floor: done " in lines[-1], lines
