"""The recovery benchmark (benchmarks/recovery_bench.py): one real run, and its log reader.

The smoke run is one repetition of one fault (a worker SIGKILLed) for
``rdzv run`` only: the table must parse, the job must have trained again,
and nothing of the run may be left running afterwards.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.procs import subprocess_env

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def timeline() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location(
        "recovery_timeline", BENCHMARKS / "recovery_timeline.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["recovery_timeline"] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules["recovery_timeline"]


def _local(stamp: str) -> float:
    return time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S"))


def test_the_three_kinds_of_lines_parse_with_their_times(timeline: ModuleType) -> None:
    worker = timeline.parse_line(
        "[rank 2]: @recovery 1796666627.899169 step rank=2 world=3 restart=1 pid=5926 step=105",
        0,
        2026,
    )
    assert (worker.t, worker.event, worker.rank, worker.world) == (1796666627.899169, "step", 2, 3)
    assert (worker.restart, worker.pid, worker.step) == (1, 5926, 105)
    rdzv = timeline.parse_line(
        "2026-12-07 18:03:33.073 rdzv run: worker rank 2 was killed by signal SIGKILL (9)", 1, 2026
    )
    assert rdzv.agent == 1
    assert rdzv.t == pytest.approx(_local("2026-12-07 18:03:33") + 0.073)
    assert rdzv.text.startswith("worker rank 2")
    torch_line = timeline.parse_line(
        "I1207 18:04:36.840000 6318 site-packages/torch/distributed/elastic/agent/server/"
        "api.py:553] [default] Rendezvous complete for workers. Result:",
        2,
        2026,
    )
    assert torch_line.t == pytest.approx(_local("2026-12-07 18:04:36") + 0.84)
    assert timeline.ROUND_COMPLETE.search(torch_line.text)
    assert timeline.parse_line("[rank0]: Traceback (most recent call last):", 0, 2026) is None


def _event(timeline: ModuleType, t: float, event: str, rank: int, world: int, pid: int) -> object:
    return timeline.WorkerEvent(t, event, rank, world, 0, pid, 1 if event == "step" else 0)


def test_training_again_needs_every_rank_of_one_size_by_new_processes(
    timeline: ModuleType,
) -> None:
    old = {10, 11, 12}
    events = [
        _event(timeline, 101.0, "step", 0, 3, 10),  # an old worker, after the fault
        _event(timeline, 103.0, "step", 0, 2, 20),  # a group of 2 that never completes
        _event(timeline, 104.0, "step", 0, 3, 30),
        _event(timeline, 104.5, "step", 1, 3, 31),
        _event(timeline, 105.0, "step", 2, 3, 32),
        _event(timeline, 106.0, "step", 1, 3, 41),  # a later step of another process
    ]
    assert timeline.first_training(events, 100.0, old, None) == (105.0, {0: 30, 1: 31, 2: 32})
    assert timeline.first_training(events, 100.0, old, 2) is None
    assert timeline.first_training(events[:4], 100.0, old, None) is None


def test_phases_come_from_the_lines_and_a_moment_not_shown_is_none(timeline: ModuleType) -> None:
    fault = 100.0
    events = [
        _event(timeline, 99.0, "step", 0, 2, 10),
        _event(timeline, 101.0, "start", 0, 2, 20),
        _event(timeline, 101.2, "start", 1, 2, 21),
        _event(timeline, 103.0, "ready", 0, 2, 20),
        _event(timeline, 103.1, "ready", 1, 2, 21),
        _event(timeline, 104.0, "step", 0, 2, 20),
        _event(timeline, 104.2, "step", 1, 2, 21),
    ]
    lines = [
        timeline.AgentLine(99.5, 0, "steady"),
        timeline.AgentLine(100.3, 2, "the killed node's last words"),
        timeline.AgentLine(100.5, 1, "worker failed"),
        timeline.AgentLine(100.9, 0, 'rdzv {"action": "complete", "rank": 0}'),
        timeline.AgentLine(101.0, 1, 'rdzv {"action": "complete", "rank": 1}'),
    ]
    ended = {10: 100.7, 11: 100.8}
    found = timeline.phases(fault, events, lines, {10, 11}, ended, {0, 1}, 2)
    assert found.knows == pytest.approx(0.5)
    assert found.stopped == pytest.approx(0.8)
    assert found.formed == pytest.approx(1.0)
    assert found.started == pytest.approx(1.2)
    assert found.ready == pytest.approx(3.1)
    assert found.step == pytest.approx(4.2)
    assert (found.world, found.restarts) == (2, 0)
    # No agent line, an old worker that never ended, no round line: None, not a guess.
    bare = timeline.phases(fault, events, [], {10, 11}, {10: 100.7, 11: None}, {0, 1}, 2)
    assert (bare.knows, bare.stopped, bare.formed) == (None, None, None)
    assert bare.step == pytest.approx(4.2)
    # A run that never trained again: no worker moments, the last round line seen.
    stuck = timeline.phases(fault, events[:5], lines, {10, 11}, ended, {0, 1}, 2)
    assert (stuck.started, stuck.ready, stuck.step, stuck.world) == (None, None, None, None)
    assert stuck.formed == pytest.approx(1.0)
    assert stuck.knows == pytest.approx(0.5)


def _row(output: str, prefix: str, cells: int) -> list[str]:
    """The one table row starting with ``prefix`` that has ``cells`` cells."""
    rows = [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in output.splitlines()
        if line.startswith(prefix)
    ]
    found = [row for row in rows if len(row) == cells]
    assert len(found) == 1, output
    return found[0]


def _running_with(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.timeout(420)
@pytest.mark.xdist_group("torch-jobs")  # one torch job at a time: see tests/netns/test_jobs.py
def test_one_worker_kill_run_of_rdzv_run_recovers_and_leaves_nothing(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed")
    logs = tmp_path / "logs"
    raw = tmp_path / "runs.json"
    done = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "recovery_bench.py"),
            *("--reps", "1", "--faults", "worker-kill", "--launchers", "rdzv"),
            *("--timeout", "150", "--settle", "0", "--logs", str(logs), "--json", str(raw)),
        ],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    output = done.stdout
    assert done.returncode == 0, output + done.stderr[-3000:]
    cells = _row(output, "| worker-kill | rdzv run |", 11)
    _, _, recovered, low, median, high, ratio, restarts, exits, orphans, load = cells
    assert recovered == "1/1", output
    assert low == median == high, output
    assert median.endswith(" s"), output
    assert 0 < float(median[:-2]) < 150
    assert ratio == "1.00x"
    assert restarts == "1", output  # the victim's node counts the failure as its restart
    assert exits == "0,0,0", output
    assert orphans == "0", output
    assert float(load) >= 0
    # agent knows, workers stopped, round formed, workers started, group ready, first step
    moments = [float(m) for m in _row(output, "| worker-kill | rdzv run |", 8)[2:]]
    assert moments[-1] == pytest.approx(float(median[:-2]), abs=0.01)
    assert all(0 <= m <= moments[-1] for m in moments), moments
    assert moments[3] <= moments[4] <= moments[5], moments  # the workers' own stamps
    (run,) = json.loads(raw.read_text())
    assert run["outcome"] == "recovered"
    assert run["recovery"]["world"] == 3
    assert _running_with(str(logs)) == []
