"""rdzv across network namespaces: is_host inference, a 3-host job, partitions.

Each agent runs in its own namespace with its own address; the c10d store is
hosted by whichever agent owns the endpoint address.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rdzv.testing.netns import NetnsBed
from tests.netns.engines import NetnsEtcd
from tests.procs import subprocess_env, wait_until

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
    bed: NetnsBed,
    out: Path,
    seconds: float,
    nnodes: str = "3",
    conf: str = "",
    backend: str = "c10d",
    endpoint: str = "",
) -> list[subprocess.Popen[str]]:
    """Start one ``rdzv run`` agent per host (the c10d endpoint on host 0 by default)."""
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
            backend,
            "--rdzv-endpoint",
            endpoint or f"{bed.hosts[0].ipv4}:{PORT}",
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


@contextlib.contextmanager
def killed_on_error(procs: list[subprocess.Popen[str]]) -> Iterator[None]:
    """On an error before :func:`finish` reaped them, kill every agent still running, by pid."""
    try:
        yield
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                proc.communicate(timeout=10)


def records(out: Path) -> list[dict[str, str]]:
    return sorted(
        (json.loads(p.read_text()) for p in out.glob("rank*.json")), key=lambda e: e["RANK"]
    )


def wait_for_records(out: Path, count: int) -> None:
    wait_until(lambda: len(records(out)) >= count, f"{count} records", 40, every=0.2)
    assert len(records(out)) == count


def check_one_round(bed: NetnsBed, out: Path) -> None:
    """Three workers of one round: ranks 0..2, MASTER_ADDR a namespace address."""
    found = records(out)
    assert [e["RANK"] for e in found] == ["0", "1", "2"]
    assert {e["WORLD_SIZE"] for e in found} == {"3"}
    assert {e["TORCHELASTIC_RESTART_COUNT"] for e in found} == {"0"}
    assert len({e["MASTER_ADDR"] for e in found}) == 1
    assert found[0]["MASTER_ADDR"] in {h.ipv4 for h in bed.hosts}


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_three_agents_in_three_namespaces_rendezvous(bed3: NetnsBed, tmp_path: Path) -> None:
    results = finish(start_agents(bed3, tmp_path, 0))
    assert [code for code, _ in results] == [0, 0, 0], results
    check_one_round(bed3, tmp_path)


@contextlib.contextmanager
def backend_on(bed: NetnsBed, backend: str) -> Iterator[str]:
    """The endpoint: c10d hosted by the agent on host 0, or an etcd member per host."""
    if backend == "c10d":
        yield f"{bed.hosts[0].ipv4}:{PORT}"
    else:
        with NetnsEtcd(bed.hosts) as etcd:
            yield etcd.endpoints


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", ["c10d", pytest.param("etcd", marks=pytest.mark.etcd)])
def test_agents_cut_from_each_other_but_not_from_the_store_are_unaffected(
    bed3: NetnsBed, tmp_path: Path, backend: str
) -> None:
    """Hosts 1 and 2 cut from each other; both reach host 0 (the store, or an etcd member).

    With etcd the members on hosts 1 and 2 are cut from each other too: the
    cluster keeps its quorum through host 0's member.
    """
    with backend_on(bed3, backend) as endpoint:
        procs = start_agents(bed3, tmp_path, 12, backend=backend, endpoint=endpoint)
        with killed_on_error(procs):
            wait_for_records(tmp_path, 3)
            bed3.cut([(1, 2)])  # host 0 (the store) still reaches both
            results = finish(procs)
    assert [code for code, _ in results] == [0, 0, 0], results
    check_one_round(bed3, tmp_path)
    assert bed3.cut_pairs() == {(1, 2)}


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", ["c10d", pytest.param("etcd", marks=pytest.mark.etcd)])
def test_a_partition_healed_before_the_keep_alive_bound_changes_nothing(
    bed3: NetnsBed, tmp_path: Path, backend: str
) -> None:
    """Host 2 cut from everyone (the store host, or the other etcd members) for 4 s < 15 s."""
    with backend_on(bed3, backend) as endpoint:
        procs = start_agents(bed3, tmp_path, 15, backend=backend, endpoint=endpoint)
        with killed_on_error(procs):
            wait_for_records(tmp_path, 3)
            bed3.isolate(2)  # cut from the store host too, for less than 5 s * 3 beats
            time.sleep(4)
            bed3.heal()
            results = finish(procs)
    assert [code for code, _ in results] == [0, 0, 0], results
    check_one_round(bed3, tmp_path)
