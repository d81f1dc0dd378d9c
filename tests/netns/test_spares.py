"""A spare takes a lost host's slot in a training job across namespaces; a sick host is kept out.

Seven hosts: host 0 runs the c10d store (``rdzv serve``); hosts 1-5 run
``rdzv run --nnodes 4:4 --keep-ranks`` with a gloo training worker
(``trainer.py``, one per host), so four form the group and one waits as a
spare; host 6 runs the same job with ``--health-check 'exit 3'
--exclude-after 1`` and is excluded at its first check. Once the group
trains, the agent of group rank 1 is SIGKILLed (its worker dies with it,
``PR_SET_PDEATHSIG``). The spare takes group rank 1, the three survivors
keep theirs, and training goes on from the last checkpointed step.
``rdzv status --json``, read from inside host 0 before and after, shows
the spare waiting, then as the member at rank 1, and the sick host
excluded with its health check's reason all along.
"""

from __future__ import annotations

import json
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
from tests.netns.conftest import open_bed
from tests.netns.test_jobs import Agents, job_env
from tests.procs import ROOT, subprocess_env, wait_until

pytest.importorskip("torch.distributed.run")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.torch,
    pytest.mark.xdist_group("torch-jobs"),  # see tests/netns/test_jobs.py
    pytest.mark.timeout(300),
]

TRAINER = str(ROOT / "tests" / "netns" / "trainer.py")
PORT = 29400
STORE, JOB, SICK = 0, (1, 2, 3, 4, 5), 6
# test_jobs' settings, with a keep-alive that forgives a survivor starved of
# CPU for 5 s (the dead agent is seen at once: the store writes its will).
CONF = "join_timeout=120,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=5"
SICK_CHECK = "echo 'nic eth1: link down' >&2; exit 3"


@pytest.fixture
def bed7() -> Iterator[NetnsBed]:
    bed = open_bed(7)
    try:
        yield bed
    finally:
        bed.close()


@pytest.fixture
def agents(bed7: NetnsBed, tmp_path: Path) -> Iterator[Agents]:
    group = Agents(bed7, tmp_path)
    try:
        yield group
    finally:
        group.stop()


def steps(out: Path) -> list[dict[str, Any]]:
    """Every step line the workers wrote (a line cut short by a kill is left out)."""
    lines = [line for p in out.glob("steps-*.jsonl") for line in p.read_text().splitlines()]
    return [json.loads(line) for line in lines if line.endswith("}")]


def ranks_of(lines: list[dict[str, Any]]) -> dict[int, int]:
    """Map each host to the group rank its workers reported (one each, else an error)."""
    found: dict[int, set[int]] = {}
    for line in lines:
        found.setdefault(line["host"], set()).add(line["group_rank"])
    assert all(len(r) == 1 for r in found.values()), found
    return {host: next(iter(r)) for host, r in found.items()}


def status(bed: NetnsBed, endpoint: str, run_id: str) -> dict[str, Any]:
    done = bed.hosts[STORE].run(
        [
            sys.executable,
            *("-m", "rdzv", "status", "--rdzv-backend=c10d"),
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={run_id}",
            "--json",
            "--sample=0",
        ],
        env=subprocess_env(),
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    data: dict[str, Any] = json.loads(done.stdout)
    return data


def members(data: dict[str, Any]) -> dict[int, str]:
    """Map each live member's rank to its address."""
    return {m["rank"]: m["address"] for m in data["members"] if not m["evicted"]}


def test_the_spare_takes_rank_1_survivors_keep_theirs_training_resumes_sick_host_excluded(
    bed7: NetnsBed, agents: Agents, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    hosts = bed7.hosts
    endpoint = f"{hosts[STORE].ipv4}:{PORT}"
    run_id = uuid.uuid4().hex
    store_log = tmp_path / "store.log"
    with store_log.open("w") as log:
        store = agents.popen(
            [
                sys.executable,
                "-m",
                "rdzv",
                "serve",
                f"--host={hosts[STORE].ipv4}",
                f"--port={PORT}",
            ],
            hosts[STORE].popen,
            env=subprocess_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    wait_until(
        lambda: "rdzv store listening" in store_log.read_text(),
        "the store listening",
        60,
        broken=store.poll,
        detail=store_log.read_text,
    )
    args = [
        sys.executable,
        *("-m", "rdzv.cli", "run", "--nnodes=4:4", "--nproc-per-node=1", "--keep-ranks"),
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        f"--rdzv-conf={CONF}",
        "--max-restarts=3",
        "--monitor-interval=0.2",
    ]
    procs = {
        index: agents.start_on(index, [*args, TRAINER], job_env(out, RDZV_TEST_HOST=str(index)))
        for index in JOB
    }
    sick = [
        f"--health-check={SICK_CHECK}",
        "--exclude-after=1",
        "--exclude-cooldown=600",
    ]
    agents.start_on(SICK, [*args, *sick, TRAINER], job_env(out, RDZV_TEST_HOST=str(SICK)))

    # The first group trains: four hosts, three steps each at least.
    agents.until(
        "four hosts training",
        lambda: len({s["host"] for s in steps(out) if s["step"] >= 3}) == 4,
    )
    before = ranks_of(steps(out))
    assert sorted(before.values()) == [0, 1, 2, 3], before
    (spare,) = set(JOB) - set(before)
    victim = next(host for host, rank in before.items() if rank == 1)
    sick_address = hosts[SICK].ipv4

    def first_status() -> dict[str, Any]:
        data = status(bed7, endpoint, run_id)
        waiting = [key.split("#")[0] for key in data["waiting"]]
        return data if waiting == [hosts[spare].ipv4] and data["excluded"] else {}

    seen = wait_until(first_status, "the spare waiting and the sick host excluded", 60, every=1)
    assert members(seen) == {rank: hosts[host].ipv4 for host, rank in before.items()}, seen
    (excluded,) = seen["excluded"]
    assert excluded["node"] == sick_address, excluded
    assert excluded["exclusions"] == 1, excluded
    assert excluded["reason"] == (
        f"health check {SICK_CHECK!r} exited with code 3; stderr: nic eth1: link down"
    ), excluded

    first_pids = {s["pid"] for s in steps(out)}
    os.kill(procs[victim].pid, signal.SIGKILL)
    procs[victim].wait(timeout=30)
    (orphan,) = {s["pid"] for s in steps(out) if s["host"] == victim}
    wait_until(lambda: not Path(f"/proc/{orphan}").exists(), "the victim's worker gone", 30)

    def resumed() -> list[dict[str, Any]]:
        later = [s for s in steps(out) if s["pid"] not in first_pids]
        return later if len({s["host"] for s in later if s["step"] >= 3}) == 4 else []

    def failed() -> list[int]:
        return [h for h, p in procs.items() if h != victim and p.poll() is not None]

    later = wait_until(
        resumed, "the re-formed group training", 180, every=0.2, broken=failed, detail=agents.output
    )
    first_max = max(s["step"] for s in steps(out) if s["pid"] in first_pids)
    after = ranks_of(later)
    assert after[spare] == 1, (before, after, spare)
    assert victim not in after, (before, after)
    for host, rank in before.items():
        if host != victim:
            assert after[host] == rank, (before, after)
    assert {s["world"] for s in later} == {4}
    # Training went on from the checkpoint, not from step 0: the weight
    # grows by 1+2+3+4 per step across both groups.
    assert first_max <= min(s["step"] for s in later) <= first_max + 1, (first_max, later)
    assert all(s["weight"] == 10.0 * s["step"] for s in steps(out)), steps(out)

    data = status(bed7, endpoint, run_id)
    assert members(data) == {rank: hosts[host].ipv4 for host, rank in after.items()}, data
    assert members(data)[1] == hosts[spare].ipv4
    assert data["waiting"] == [], data
    assert [e["node"] for e in data["excluded"]] == [sick_address], data
    assert data["round"] > seen["round"], (seen, data)

    (out / "stop").touch()
    wait_until(
        lambda: all(procs[h].poll() is not None for h in after),
        "the job's agents to exit",
        120,
        every=0.2,
        detail=agents.output,
    )
    assert {h: procs[h].returncode for h in after} == dict.fromkeys(after, 0), agents.output()
    assert not any(s["host"] == SICK for s in steps(out))
    assert (
        f"node {sick_address} is excluded from run" in (tmp_path / f"agent-{SICK}.log").read_text()
    )
