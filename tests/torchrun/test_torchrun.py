"""Real torchrun jobs on loopback with ``--rdzv-backend=rdzv``: two agents x two workers."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator

import pytest

from rdzv.auth import AUTH_TOKEN_ENV
from rdzv.registry import rendezvous_handler_registry
from tests.certs import make_tls_files
from tests.procs import free_port
from tests.torchrun.conftest import Job

pytest.importorskip("torch.distributed.run")

# One torch job at a time under xdist: see tests/netns/test_jobs.py.
pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.xdist_group("torch-jobs")]

CONF = "join_timeout=60,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"


def torchrun_args(
    endpoint: str, nnodes: str, run_id: str, backend: str = "rdzv", conf: str = CONF
) -> list[str]:
    return [
        f"--nnodes={nnodes}",
        "--nproc-per-node=2",
        f"--rdzv-backend={backend}",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        f"--rdzv-conf={conf}",
        "--max-restarts=3",
        "--monitor-interval=0.2",
    ]


def expected_sum(world: int) -> float:
    return float(world * (world + 1) // 2)


def check_results(job: Job, world: int) -> None:
    results = sorted(job.markers("result"), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == list(range(world)), job.output()
    assert {r["world"] for r in results} == {world}
    assert {r["sum"] for r in results} == {expected_sum(world)}


@pytest.mark.timeout(90)
def test_two_agents_two_workers_all_reduce(job: Job) -> None:
    args = torchrun_args(f"127.0.0.1:{free_port()}", "2", uuid.uuid4().hex)
    job.start_agent(args)
    job.start_agent(args)
    assert job.wait() == [0, 0], job.output()
    check_results(job, 4)


@pytest.mark.timeout(100)
def test_killed_worker_is_restarted_and_the_job_finishes(job: Job) -> None:
    gate = job.out.parent / "gate"
    args = torchrun_args(f"127.0.0.1:{free_port()}", "2", uuid.uuid4().hex)
    job.start_agent(args, RDZV_TEST_GATE=str(gate))
    job.start_agent(args, RDZV_TEST_GATE=str(gate))
    job.until("four workers running", lambda: len(job.markers("started")) == 4)
    victim = next(m for m in job.markers("started") if m["rank"] == 3)
    gate.touch()  # workers started after the kill go straight to the all-reduce
    os.kill(victim["pid"], signal.SIGKILL)
    assert job.wait() == [0, 0], job.output()
    check_results(job, 4)
    restarted = [m for m in job.markers("started") if m["restart"] >= 1]
    assert restarted, "torch's agent did not restart the failed worker group"
    assert victim["pid"] not in {m["pid"] for m in restarted}


@pytest.mark.timeout(100)
def test_third_agent_joins_at_the_next_round(job: Job) -> None:
    args = torchrun_args(f"127.0.0.1:{free_port()}", "2:3", uuid.uuid4().hex)
    job.start_agent(args, RDZV_TEST_WORLD="6")
    job.start_agent(args, RDZV_TEST_WORLD="6")
    job.until(
        "the first round's four workers running",
        lambda: len([m for m in job.markers("started") if m["world"] == 4]) == 4,
    )
    job.start_agent(args, RDZV_TEST_WORLD="6")
    assert job.wait() == [0, 0, 0], job.output()
    check_results(job, 6)


@pytest.mark.timeout(120)
def test_two_agents_over_tls_with_a_secret(job: Job) -> None:
    files = make_tls_files(job.logs / "tls")
    tls = f"ca_cert={files.ca_cert},ssl_cert={files.server_cert},ssl_cert_key={files.server_key}"
    args = torchrun_args(f"127.0.0.1:{free_port()}", "2", uuid.uuid4().hex, conf=f"{CONF},{tls}")
    secret = {AUTH_TOKEN_ENV: "torchrun over tls"}
    job.start_agent(args, **secret)
    job.start_agent(args, **secret)
    assert job.wait() == [0, 0], job.output()
    check_results(job, 4)
    # The store is really guarded: an agent with another secret is refused.
    endpoint, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex
    host = torchrun_args(endpoint, "2", run_id, conf=f"{CONF},{tls},is_host=1")
    guest = torchrun_args(endpoint, "2", run_id, conf=f"{CONF},{tls},is_host=0")
    job.start_agent(host, **secret)
    intruder = job.start_agent(guest, **{AUTH_TOKEN_ENV: "not the secret"})
    assert intruder.wait(60) != 0
    assert "refused auth_token" in job.output(200)


def spare_enqueued(endpoint: str, run_id: str) -> bool:
    """Ask the rendezvous, as a non-member, whether a node waits for the next round."""
    from rdzv.api import RendezvousParameters
    from rdzv.dynamic.handler import DynamicRendezvousHandler

    params = RendezvousParameters("c10d", endpoint, run_id, 2, 2, config={"is_host": False})
    handler = rendezvous_handler_registry.create_handler(params)
    assert isinstance(handler, DynamicRendezvousHandler)
    try:
        return handler.num_nodes_waiting() > 0
    finally:
        handler.close()


@pytest.mark.timeout(100)
def test_a_spare_agent_exits_when_the_job_finishes(job: Job) -> None:
    gate = job.out.parent / "gate"
    endpoint, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex
    args = torchrun_args(endpoint, "2", run_id)
    for _ in range(3):
        job.start_agent(args, RDZV_TEST_GATE=str(gate))
    job.until("four workers running", lambda: len(job.markers("started")) == 4)
    job.until("the spare waiting", lambda: spare_enqueued(endpoint, run_id))
    gate.touch()
    codes = job.wait()
    check_results(job, 4)
    assert codes == [0, 0, 0], job.output()
    assert "is a spare of the closed run" in job.output(200)


@pytest.fixture(params=["etcd", "redis"])
def engine(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """``(torchrun backend, endpoint)`` of a private etcd or Redis on free loopback ports."""
    name = request.param
    if name not in rendezvous_handler_registry.backends():
        pytest.skip(f"rdzv's {name} backend is not in this tree")
    servers = pytest.importorskip("tests.engines.servers")
    start = servers.etcd_cluster if name == "etcd" else servers.redis_server
    with start() as server:
        yield f"rdzv-{name}", server.endpoint


@pytest.mark.etcd
@pytest.mark.redis
@pytest.mark.timeout(100)
def test_two_agents_two_workers_all_reduce_on_an_engine(job: Job, engine: tuple[str, str]) -> None:
    backend, endpoint = engine
    args = torchrun_args(endpoint, "2", uuid.uuid4().hex, backend=backend)
    job.start_agent(args)
    job.start_agent(args)
    assert job.wait() == [0, 0], job.output()
    check_results(job, 4)
