"""Elasticity end to end: ``rdzv run`` agents on the c10d backend, real processes.

A store server (``rdzv serve``) runs on its own so that any agent can be
killed; the workers (``worker.py wait-release``) run until the test releases
the current world size, so the test decides when a round may finish.
"""

from __future__ import annotations

import signal
from datetime import timedelta
from pathlib import Path

import pytest

from rdzv.store.tcp import TCPStore
from tests.launch.procs import (
    ALLREDUCE,
    WORKER,
    agents,
    alive,
    c10d_args,
    envs,
    finish,
    kill_pids,
    with_world,
)
from tests.procs import free_port, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_a_third_agent_grows_the_group_without_a_restart(endpoint: str, tmp_path: Path) -> None:
    args = [*c10d_args(endpoint, "2:3", "grow"), WORKER, str(tmp_path), "wait-release"]
    with agents() as group:
        first = [group.start(args), group.start(args)]
        wait_until(lambda: len(with_world(tmp_path, 2)) >= 2, what="a round of 2 nodes")
        third = group.start(args)
        wait_until(lambda: len(with_world(tmp_path, 3)) >= 3, what="a round of 3 nodes")
        (tmp_path / "release-3").write_text("")
        results = [finish(p) for p in [*first, third]]
    assert [code for code, _, _ in results] == [0, 0, 0], results
    grown = with_world(tmp_path, 3)
    assert {e["RANK"] for e in grown} == {"0", "1", "2"}
    assert {e["TORCHELASTIC_RESTART_COUNT"] for e in envs(tmp_path)} == {"0"}
    assert any("not counted as a restart" in err for _, _, err in results[:2])


def test_a_killed_agent_shrinks_the_group(endpoint: str, tmp_path: Path) -> None:
    args = [*c10d_args(endpoint, "1:3", "shrink"), WORKER, str(tmp_path), "wait-release"]
    pids: list[int] = []
    try:
        with agents() as group:
            procs = [group.start(args) for _ in range(3)]
            wait_until(lambda: len(with_world(tmp_path, 3)) >= 3, what="a round of 3 nodes")
            victim_group = with_world(tmp_path, 3)[0]["GROUP_RANK"]
            pids = [int(e["pid"]) for e in envs(tmp_path)]
            # find the agent whose node has that group rank: its worker's parent
            victim_pid = next(
                int(e["pid"]) for e in with_world(tmp_path, 3) if e["GROUP_RANK"] == victim_group
            )
            victim = next(p for p in procs if _is_parent(p.pid, victim_pid))
            victim.kill()
            wait_until(lambda: len(with_world(tmp_path, 2)) >= 2, what="a round of 2 nodes")
            (tmp_path / "release-2").write_text("")
            survivors = [p for p in procs if p is not victim]
            results = [finish(p) for p in survivors]
        assert [code for code, _, _ in results] == [0, 0], results
        wait_until(lambda: not alive(victim_pid), timeout=10, what="the victim's worker to end")
        # Each round of 2 (an extra one may form first under load, before
        # the third agent arrives) ranks its two workers 0 and 1.
        assert {e["RANK"] for e in with_world(tmp_path, 2)} == {"0", "1"}
        assert {e["TORCHELASTIC_RESTART_COUNT"] for e in envs(tmp_path)} == {"0"}
    finally:
        kill_pids(pids)


def _is_parent(parent: int, child: int) -> bool:
    try:
        stat = Path(f"/proc/{child}/stat").read_text()
    except OSError:
        return False
    return int(stat.rsplit(")", 1)[1].split()[1]) == parent


def test_a_spare_agent_exits_zero(endpoint: str, tmp_path: Path) -> None:
    args = [*c10d_args(endpoint, "1:2", "spare"), WORKER, str(tmp_path), "wait-release"]
    with agents() as group:
        members = [group.start(args), group.start(args)]
        wait_until(lambda: len(with_world(tmp_path, 2)) >= 2, what="a round of 2 nodes")
        started = len(envs(tmp_path))
        spare_log = tmp_path / "spare.err"
        spare = group.start(["--verbose", *args], stderr_path=spare_log)
        wait_until(
            lambda: '"action": "enqueue"' in spare_log.read_text(), what="the spare to queue"
        )
        # the group is full: the members are not disturbed by the spare
        (tmp_path / "release-2").write_text("")
        member_results = [finish(p) for p in members]
        code, _, _ = finish(spare)
    err = spare_log.read_text()
    assert [c for c, _, _ in member_results] == [0, 0], member_results
    assert len(envs(tmp_path)) == started
    assert code == 0, err
    assert "spare" in err.strip().splitlines()[-1]


def test_an_agent_stopped_with_sigterm_leaves_the_run_open(endpoint: str, tmp_path: Path) -> None:
    args = [*c10d_args(endpoint, "1:2", "rejoin"), WORKER, str(tmp_path), "wait-release"]
    with agents() as group:
        stays = group.start(args)
        leaves = group.start(args)
        wait_until(lambda: len(with_world(tmp_path, 2)) >= 2, what="a round of 2 nodes")
        before = len(with_world(tmp_path, 2))
        leaves.send_signal(signal.SIGTERM)
        code, _, err = finish(leaves)
        assert code == 128 + signal.SIGTERM, err
        # the other node goes on alone, and a new agent can still join the run
        wait_until(lambda: len(with_world(tmp_path, 1)) >= 1, what="a round of 1 node")
        group.start(args)
        wait_until(
            lambda: len(with_world(tmp_path, 2)) >= before + 2, what="a new round of 2 nodes"
        )
        (tmp_path / "release-2").write_text("")
        code, _, err = finish(stays)
        assert code == 0, err


@pytest.mark.torch
def test_torch_gloo_allreduce_two_agents_two_workers(tmp_path: Path) -> None:
    # the first agent hosts the c10d store itself (endpoint on this machine)
    endpoint = f"127.0.0.1:{free_port()}"
    args = [
        "--nnodes=2",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        "--rdzv-id=gloo",
        "--local-addr=127.0.0.1",
        ALLREDUCE,
    ]
    with agents() as group:
        procs = [group.start(args), group.start(args)]
        results = [finish(p, timeout=100) for p in procs]
    assert [code for code, _, _ in results] == [0, 0], results
    out = results[0][1] + results[1][1]
    assert out.count("expected 10.0: ok") == 4
    # the agent hosting the rendezvous store waited for the other to leave
    assert all("did not reach the backend" not in err for _, _, err in results)
    for rank in range(4):
        assert f"[rank {rank}]: rank {rank}/4" in out


def test_a_join_timeout_names_who_came_and_the_other_runs(endpoint: str, tmp_path: Path) -> None:
    def args(run_id: str, nnodes: str) -> list[str]:
        conf = "is_host=false,join_timeout=4,last_call_timeout=0.5,keep_alive_interval=0.5"
        return [
            f"--nnodes={nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={run_id}",
            f"--rdzv-conf={conf}",
            "--local-addr=127.0.0.1",
            WORKER,
            str(tmp_path),
            "ok",
        ]

    with agents() as group:
        other = group.start(args("other-run", "2"))  # queued, never complete: its keys stay
        # On a loaded machine its agent may take seconds to start: the others
        # start once its record is in the store.
        host, port = endpoint.rsplit(":", 1)
        probe = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30))
        try:
            wait_until(
                lambda: probe.check(["rdzv.backend/other-run/q/0"]), what="the other run's queue"
            )
        finally:
            probe.close()
        waiting = [group.start(args("short", "3")) for _ in range(2)]
        results = [finish(p) for p in waiting]
        finish(other)
    lasts = [err.strip().splitlines()[-1] for _, _, err in results]
    assert [code for code, _, _ in results] == [3, 3], results
    for last in lasts:
        assert "RendezvousExhaustedError: the join window of 4 s elapsed" in last, last
        assert "nodes that came: " in last, last
        assert "other runs on this store: 'other-run'" in last, last
    # the first to time out saw the other node of its run still queued
    assert any("nodes that came: 127.0.0.1#" in last for last in lasts), lasts
