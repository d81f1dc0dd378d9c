"""The workers' bootstrap store: sized for the round, torch's libuv server or rdzv's."""

from __future__ import annotations

import resource
import socket
import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest

from rdzv.launch.bootstrap import (
    CONNECTIONS_PER_WORKER,
    TORCH_SERVER_MIN_WORLD,
    BootstrapSpec,
    bootstrap_server,
    connection_limit,
)
from rdzv.store.server import DEFAULT_MAX_CONNECTIONS
from rdzv.store.tcp import TCPStore
from tests.procs import subprocess_env


def _child(code: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.communicate(timeout=30)


def test_the_limit_is_derived_from_the_round() -> None:
    big = BootstrapSpec(world_size=16384, nodes=2048)
    assert connection_limit(big) >= CONNECTIONS_PER_WORKER * 16384 + 2048 > DEFAULT_MAX_CONNECTIONS
    assert connection_limit(BootstrapSpec(5000, 625)) > 2 * 5000  # past the server's default
    assert connection_limit(BootstrapSpec(8, 1)) == DEFAULT_MAX_CONNECTIONS  # never below it
    # bounded: a bigger round is needed for more connections
    assert connection_limit(BootstrapSpec(5000, 625)) < connection_limit(BootstrapSpec(6000, 750))


@pytest.mark.parametrize(("field", "spec"), [("world_size", (0, 1)), ("nodes", (4, 0))])
def test_a_bad_spec_names_its_field(field: str, spec: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match=field):
        BootstrapSpec(*spec)


@pytest.mark.slow
def test_the_open_file_limit_is_raised_up_to_the_hard_limit_never_lowered() -> None:
    proc = _child(
        """
        import resource
        from rdzv.launch.bootstrap import raise_open_files
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, hard))
        raised = raise_open_files(1000)
        again = raise_open_files(10)
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 512))
        capped = raise_open_files(5000)
        print(raised, again, capped, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        """
    )
    out, _ = proc.communicate(timeout=60)
    raised, again, capped, now = (int(x) for x in out.split())
    assert raised >= 1000  # room made
    assert again == raised  # and never lowered after
    assert capped == now == 512  # the hard limit is the ceiling


@pytest.mark.slow
def test_rdzv_server_admits_a_round_past_its_open_file_limit() -> None:
    """With 128 descriptors a default server would cap its connections far below 300."""
    workers = 300
    proc = _child(
        f"""
        import resource, sys
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, hard))
        from rdzv.launch.bootstrap import BootstrapSpec, rdzv_store_server
        server = rdzv_store_server(BootstrapSpec({workers}, 38))
        print(server.port, resource.getrlimit(resource.RLIMIT_NOFILE)[0], flush=True)
        sys.stdin.read()
        """
    )
    clients: list[TCPStore] = []
    try:
        assert proc.stdout is not None
        port, soft = (int(x) for x in proc.stdout.readline().split())
        assert soft > workers
        counts = []
        for _ in range(workers):
            client = TCPStore("127.0.0.1", port, timeout=30)
            clients.append(client)
            counts.append(client.add("joined", 1))
        assert sorted(counts) == list(range(1, workers + 1))
        assert clients[-1].add("joined", 0) == workers  # all of them are still connected
    finally:
        for client in clients:
            client.close()
        _stop(proc)


@pytest.mark.slow
def test_without_torch_the_round_gets_rdzvs_server() -> None:
    proc = _child(
        f"""
        import sys
        sys.modules["torch"] = None  # torch cannot be imported
        from rdzv.launch.bootstrap import BootstrapSpec, bootstrap_server, torch_available
        server = bootstrap_server(BootstrapSpec({TORCH_SERVER_MIN_WORLD * 4}, 512))
        print(torch_available(), type(server).__module__, server.port, flush=True)
        sys.stdin.read()
        """
    )
    try:
        assert proc.stdout is not None
        available, module, port = proc.stdout.readline().split()
        assert (available, module) == ("False", "rdzv.store.tcp")
        client = TCPStore("127.0.0.1", int(port), timeout=30)
        client.set("k", "v")
        assert client.get("k") == b"v"
        client.close()
    finally:
        _stop(proc)


@pytest.mark.slow
@pytest.mark.torch
def test_a_large_round_gets_torchs_libuv_server_bound_to_its_host() -> None:
    from torch._C._distributed_c10d import TCPStore as TorchTCPStore

    small = bootstrap_server(BootstrapSpec(TORCH_SERVER_MIN_WORLD - 1))
    assert isinstance(small, TCPStore)
    small.close()
    server = bootstrap_server(BootstrapSpec(TORCH_SERVER_MIN_WORLD, 128, ("127.0.0.1",)))
    assert type(server).__name__ == "TorchStoreServer"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft >= min(connection_limit(BootstrapSpec(TORCH_SERVER_MIN_WORLD, 128)), hard)
    client = TorchTCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=30))
    client.set("addr/0", "10.0.0.1:29500")
    assert client.add("count", 1) == 1
    assert client.get("addr/0") == b"10.0.0.1:29500"
    with pytest.raises(ConnectionRefusedError):  # bound to 127.0.0.1, not every address
        socket.create_connection(("127.0.0.2", server.port), timeout=10).close()
    del client
    server.close()
    with pytest.raises(ConnectionRefusedError):  # closed: nothing listens any more
        socket.create_connection(("127.0.0.1", server.port), timeout=10).close()


_GLOO_WORKER = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print(int(t.item()))
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.torch
def test_workers_init_their_process_group_on_torchs_server_as_handed_over() -> None:
    from rdzv.launch.torch_server import torch_store_server

    server = torch_store_server(None, 64)  # every address, as the agent starts it
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(server.port),
        "WORLD_SIZE": "2",
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # as rdzv run's workers: clients only
    }
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", _GLOO_WORKER],
            stdout=subprocess.PIPE,
            text=True,
            env=subprocess_env(RANK=str(rank), LOCAL_RANK=str(rank), **env),
        )
        for rank in range(2)
    ]
    try:
        outs = [w.communicate(timeout=120)[0] for w in workers]
        assert [w.returncode for w in workers] == [0, 0]
        assert [o.split()[-1] for o in outs] == ["2", "2"]  # the all-reduce of both ranks
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.communicate(timeout=30)
        server.close()
