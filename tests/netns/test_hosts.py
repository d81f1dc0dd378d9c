"""rdzv across network namespaces: is_host inference, a 3-host job, partitions.

Each agent runs in its own namespace with its own address; the c10d store is
hosted by whichever agent owns the endpoint address.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rdzv.testing.netns import NetnsBed
from tests.netns.conftest import open_bed
from tests.procs import subprocess_env

WORKER = str(Path(__file__).with_name("worker.py"))
PORT = 29455

INFER = """
import json, sys
from rdzv.api import RendezvousParameters
from rdzv.backends.options import StoreBackendOptions, endpoint_is_local
from rdzv.net import source_address
v4, v6 = sys.argv[1:3]
params = RendezvousParameters("c10d", f"{v4}:29400", "job", 1, 1)
print(json.dumps({
    "hosts": StoreBackendOptions.from_params(params).should_host(),
    "v4_local": endpoint_is_local(v4),
    "v6_local": endpoint_is_local(v6),
    "source": source_address(v4),
}))
"""


@pytest.fixture
def bed3() -> Iterator[NetnsBed]:
    bed = open_bed(3)
    try:
        yield bed
    finally:
        bed.close()


@pytest.mark.timeout(60)
def test_is_host_is_inferred_from_the_namespace_addresses(bed3: NetnsBed) -> None:
    a, b, _ = bed3.hosts
    seen = {}
    for host in (a, b):
        done = host.run(
            [sys.executable, "-c", INFER, a.ipv4, a.ipv6], env=subprocess_env(), check=True
        )
        seen[host.index] = json.loads(done.stdout)
    assert seen[0] == {"hosts": True, "v4_local": True, "v6_local": True, "source": a.ipv4}
    assert seen[1] == {"hosts": False, "v4_local": False, "v6_local": False, "source": b.ipv4}


def start_agents(
    bed: NetnsBed, out: Path, seconds: float, nnodes: str = "3", conf: str = ""
) -> list[subprocess.Popen[str]]:
    """Start one ``rdzv run`` agent per host, the endpoint on host 0."""
    procs = []
    for host in bed.hosts:
        args = [
            sys.executable,
            "-m",
            "rdzv.cli",
            "run",
            "--nnodes",
            nnodes,
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"{bed.hosts[0].ipv4}:{PORT}",
            "--rdzv-id",
            "job",
        ]
        if conf:
            args += ["--rdzv-conf", conf]
        procs.append(host.popen([*args, WORKER, str(out), str(seconds)], env=subprocess_env()))
    return procs


def finish(procs: list[subprocess.Popen[str]], timeout: float = 50) -> list[tuple[int, str]]:
    """Wait for every agent (killing all by pid on a timeout); return (code, stderr)."""
    deadline = time.monotonic() + timeout
    results = []
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            results.append((proc.returncode, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=10)
    return results


def records(out: Path) -> list[dict[str, str]]:
    return sorted(
        (json.loads(p.read_text()) for p in out.glob("rank*.json")), key=lambda e: e["RANK"]
    )


def check_one_round(bed: NetnsBed, out: Path) -> None:
    """Three workers of one round: ranks 0..2, MASTER_ADDR a namespace address."""
    found = records(out)
    assert [e["RANK"] for e in found] == ["0", "1", "2"]
    assert {e["WORLD_SIZE"] for e in found} == {"3"}
    assert {e["TORCHELASTIC_RESTART_COUNT"] for e in found} == {"0"}
    assert len({e["MASTER_ADDR"] for e in found}) == 1
    assert found[0]["MASTER_ADDR"] in {h.ipv4 for h in bed.hosts}


@pytest.mark.timeout(60)
def test_three_agents_in_three_namespaces_rendezvous(bed3: NetnsBed, tmp_path: Path) -> None:
    results = finish(start_agents(bed3, tmp_path, 0))
    assert [code for code, _ in results] == [0, 0, 0], results
    check_one_round(bed3, tmp_path)


@pytest.mark.timeout(60)
def test_agents_cut_from_each_other_but_not_from_the_store_are_unaffected(
    bed3: NetnsBed, tmp_path: Path
) -> None:
    procs = start_agents(bed3, tmp_path, 12)
    deadline = time.monotonic() + 40
    while len(records(tmp_path)) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(records(tmp_path)) == 3
    bed3.cut([(1, 2)])  # host 0 (the store) still reaches both
    results = finish(procs)
    assert [code for code, _ in results] == [0, 0, 0], results
    check_one_round(bed3, tmp_path)
    assert bed3.cut_pairs() == {(1, 2)}


@pytest.mark.timeout(60)
def test_a_partition_healed_before_the_keep_alive_bound_changes_nothing(
    bed3: NetnsBed, tmp_path: Path
) -> None:
    procs = start_agents(bed3, tmp_path, 15)
    deadline = time.monotonic() + 40
    while len(records(tmp_path)) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(records(tmp_path)) == 3
    bed3.isolate(2)  # cut from the store host too, for less than 5 s * 3 beats
    time.sleep(4)
    bed3.heal()
    results = finish(procs)
    assert [code for code, _ in results] == [0, 0, 0], results
    check_one_round(bed3, tmp_path)
