"""Real multi-node torch jobs across namespaces on etcd (a member per host) and Redis.

Three agents, one per host, two gloo workers each; the rendezvous state is in
a 3-member etcd cluster (one member per host) or in Redis on host 0. Workers
find each other through ``MASTER_ADDR``, the namespace address group rank 0
published, and talk over ``eth0`` (``GLOO_SOCKET_IFNAME``: each host's name
resolves to loopback here, as on many machines).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rdzv.testing.netns import NetnsBed
from tests.netns.engines import engine
from tests.procs import ROOT, LoggedAgents, read_markers, subprocess_env

pytest.importorskip("torch.distributed.run")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.torch,
    pytest.mark.etcd,
    pytest.mark.redis,
    # Under pytest-xdist (bash scripts/test) the jobs that run torch workers
    # (these, tests/torchrun/test_torchrun.py, tests/launch/test_node_loss.py)
    # run one after another in one worker, handed out first; the other worker
    # takes lighter tests meanwhile. Two at once starved each other's workers
    # on two cores past their 60 s budget.
    pytest.mark.xdist_group("torch-jobs"),
]

ALLREDUCE = str(ROOT / "examples" / "allreduce.py")
GATED = str(ROOT / "tests" / "torchrun" / "worker.py")
CONF = "join_timeout=60,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"


def job_env(out: Path, **extra: str) -> dict[str, str]:
    return subprocess_env(
        GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1", RDZV_TEST_OUT=str(out), **extra
    )


class Agents(LoggedAgents):
    """One agent process per host (log ``agent-<host>.log``); every one stopped by pid."""

    def __init__(self, bed: NetnsBed, logs: Path) -> None:
        super().__init__(logs)
        self.bed = bed

    def start_on(self, index: int, args: list[str], env: dict[str, str]) -> subprocess.Popen[Any]:
        return self.start(args, env, name=index, popen=self.bed.hosts[index].popen)


@pytest.fixture
def agents(bed3: NetnsBed, tmp_path: Path) -> Iterator[Agents]:
    group = Agents(bed3, tmp_path)
    try:
        yield group
    finally:
        group.stop()


def rdzv_run(backend: str, endpoint: str, nnodes: str, script: str, run_id: str) -> list[str]:
    return [
        sys.executable,
        *("-m", "rdzv.cli", "run", f"--nnodes={nnodes}", "--nproc-per-node=2"),
        f"--rdzv-backend={backend}",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        f"--rdzv-conf={CONF}",
        "--max-restarts=3",
        "--monitor-interval=0.2",
        script,
    ]


def check_results(out: Path, world: int, agents: Agents) -> None:
    results = sorted(read_markers(out, "result-*"), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == list(range(world)), agents.output()
    assert {r["world"] for r in results} == {world}
    assert {r["sum"] for r in results} == {float(world * (world + 1) // 2)}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend", ["etcd", "redis"])
def test_three_hosts_two_workers_each_all_reduce(
    bed3: NetnsBed, agents: Agents, tmp_path: Path, backend: str
) -> None:
    with engine(bed3, backend) as endpoint:
        args = rdzv_run(backend, endpoint, "3", ALLREDUCE, uuid.uuid4().hex)
        for index in range(3):
            agents.start_on(index, args, job_env(tmp_path))
        assert agents.wait() == [0, 0, 0], agents.output()
    output = agents.output()
    assert output.count("all_reduce -> [21.0, 21.0, 21.0, 21.0], expected 21.0: ok") == 6, output
    for rank in range(6):
        assert f"rank {rank}/6" in output


@pytest.mark.timeout(150)
def test_torchrun_three_hosts_all_reduce_on_the_rdzv_backend(
    bed3: NetnsBed, agents: Agents, tmp_path: Path, entry_points_path: str
) -> None:
    """torchrun --rdzv-backend=rdzv: the agent on host 0 owns the endpoint and hosts the store."""
    out = tmp_path / "out"
    out.mkdir()
    env = job_env(out)
    if entry_points_path:
        env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], entry_points_path])
    args = [
        sys.executable,
        *("-m", "torch.distributed.run", "--nnodes=3", "--nproc-per-node=2"),
        "--rdzv-backend=rdzv",
        f"--rdzv-endpoint={bed3.hosts[0].ipv4}:29400",
        f"--rdzv-id={uuid.uuid4().hex}",
        f"--rdzv-conf={CONF}",
        "--monitor-interval=0.2",
    ]
    for host in bed3.hosts:
        # No --local-addr: each host's name resolves to loopback here, so the
        # address published must be the one facing the endpoint.
        agents.start_on(host.index, [*args, GATED], env)
    assert agents.wait() == [0, 0, 0], agents.output()
    check_results(out, 6, agents)


@pytest.mark.timeout(180)
def test_a_worker_killed_on_one_host_restarts_the_job_which_finishes(
    bed3: NetnsBed, agents: Agents, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    out = tmp_path / "out"
    out.mkdir()
    with engine(bed3, "etcd") as endpoint:
        args = rdzv_run("etcd", endpoint, "3", GATED, uuid.uuid4().hex)
        for index in range(3):
            agents.start_on(index, args, job_env(out, RDZV_TEST_GATE=str(gate)))
        agents.until("six workers running", lambda: len(read_markers(out, "started-*")) == 6)
        first = {m["pid"] for m in read_markers(out, "started-*")}
        victim = next(m for m in read_markers(out, "started-*") if m["rank"] == 3)
        gate.touch()  # workers started after the kill go straight to the all-reduce
        os.kill(victim["pid"], signal.SIGKILL)
        assert agents.wait() == [0, 0, 0], agents.output()
    check_results(out, 6, agents)
    # Every host started a new group; the victim's host counts it as a restart.
    again = [m for m in read_markers(out, "started-*") if m["pid"] not in first]
    assert sorted(m["rank"] for m in again) == list(range(6)), agents.output()
    assert {m["restart"] for m in again if m["rank"] in (2, 3)} == {1}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["etcd", "redis"])
def test_an_isolated_host_is_left_out_then_rejoins_after_healing(
    bed3: NetnsBed, agents: Agents, tmp_path: Path, backend: str
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    gate = tmp_path / "gate"
    with engine(bed3, backend) as endpoint:
        args = rdzv_run(backend, endpoint, "2:3", GATED, uuid.uuid4().hex)
        env = job_env(out, RDZV_TEST_WORLD="6", RDZV_TEST_GATE=str(gate))
        for index in range(3):
            agents.start_on(index, args, env)
        agents.until("a round of three hosts", lambda: len(started(out, 6)) == 6)
        first = {m["pid"] for m in started(out, 6)}
        isolated = 2 if backend == "etcd" else 1  # Redis lives on host 0
        bed3.isolate(isolated)
        agents.until(
            "the other two hosts re-forming without the isolated one",
            lambda: len(started(out, 4)) >= 4,
        )
        bed3.heal()
        agents.until(
            "a new round of three hosts after healing",
            lambda: len([m for m in started(out, 6) if m["pid"] not in first]) == 6,
        )
        gate.touch()
        assert agents.wait(150) == [0, 0, 0], agents.output()
    check_results(out, 6, agents)
    assert sorted(m["rank"] for m in started(out, 4))[:4] == [0, 1, 2, 3]


def started(out: Path, world: int) -> list[dict[str, Any]]:
    return [m for m in read_markers(out, "started-*") if m["world"] == world]
