"""``rdzv run``'s admission flags: bad values exit 2 naming the key; the progress line counts toward the target."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from rdzv.cli import main
from rdzv.dynamic.admission_options import shown_target
from rdzv.dynamic.state import (
    JoinRecord,
    RendezvousState,
    encode_record,
    encode_state,
    make_node_key,
)
from rdzv.launch.options import admission_conf
from rdzv.launch.progress import WaitProgress
from rdzv.status import HeartbeatTracker, format_status, read_status
from rdzv.testing import FakeClock, InMemoryBackend
from tests.launch.procs import WORKER

# An endpoint nothing listens on: the options must fail before anything connects.
ENDPOINT = ["--rdzv-endpoint", "127.0.0.1:1"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nnodes", "1:3", "--node-multiple", "4"], "node_multiple: no multiple of 4"),
        (["--nnodes", "1:8", "--target-nodes", "9"], "target_nodes=9"),
        (["--nnodes", "1:8", "--target-nodes", "slurm"], "target_nodes=slurm"),
        (["--nnodes", "1:8", "--segment-size", "2"], "segment_size needs rank_order_key"),
        (["--nnodes", "1:8", "--rank-order-key", "RDZV_TEST_NO_SUCH_VAR"], "rank_order_key="),
        (
            ["--nnodes", "1:8", "--keep-ranks", "--rdzv-conf", "keep_ranks=false"],
            "--keep-ranks true and --rdzv-conf keep_ranks=false disagree",
        ),
        (["--nnodes", "1:8", "--rdzv-conf", "node_multiple=x"], "'node_multiple'"),
    ],
)
def test_bad_admission_options_exit_2_naming_the_key(
    argv: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SLURM_NNODES", raising=False)
    monkeypatch.delenv("SLURM_JOB_NUM_NODES", raising=False)
    assert main(["run", "--no-slurm", *ENDPOINT, *argv, WORKER]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.startswith("rdzv run: error:")
    assert "Traceback" not in err


def test_flags_set_their_conf_keys() -> None:
    args = argparse.Namespace(
        target_nodes="slurm", node_multiple=2, keep_ranks=True, rank_order_key=None
    )
    assert admission_conf(args, {"segment_size": "2"}) == {
        "segment_size": "2",
        "target_nodes": "slurm",
        "node_multiple": "2",
        "keep_ranks": "true",
    }
    assert admission_conf(argparse.Namespace(), {"a": "1"}) == {"a": "1"}


def test_the_progress_line_counts_toward_the_target() -> None:
    lines: list[str] = []
    clock = FakeClock()
    progress = WaitProgress("job", lines.append, first=0.0, every=3600.0, clock=clock)
    progress.event(
        {
            "action": "waiting",
            "round": 0,
            "joined": 5,
            "min_nodes": 2,
            "max_nodes": 16,
            "target_nodes": 8,
            "timeout_in": 100.0,
            "last_call_in": 20.0,
        }
    )
    line = progress._line(1.0, clock())
    assert "; 5 of target 8 (min 2 / max 16) nodes joined" in line
    assert "unless 3 more nodes join" in line


def test_status_shows_the_target_and_the_waiting_nodes_keys() -> None:
    backend = InMemoryBackend()
    a, b, c = (make_node_key(f"10.0.0.{i}", 1, "x") for i in (1, 2, 3))
    backend.set_state(encode_state(RendezvousState(0, (a, b))), None)
    backend.enqueue(1, encode_record(JoinRecord(c, topology="sw2")))
    status = read_status(backend, "job", HeartbeatTracker())
    assert status.waiting_keys == {c: "sw2"}
    shown = format_status(dataclasses.replace(status, target_nodes=4))
    assert f"waiting for round 1: 1 of target 4: {c} (sw2)" in shown
    assert shown_target({"target_nodes": "slurm"}, {"SLURM_NNODES": "4"}) == 4
    assert shown_target({"target_nodes": "x"}, {}) is None
    assert shown_target({}, {}) is None
