"""Wire compatibility with torch 2.13 both ways, and ``rdzv serve`` as a real process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

from rdzv.errors import StoreAuthenticationError
from rdzv.store.tcp import TCPStore
from tests.procs import subprocess_env
from tests.store.helpers import serve_process

pytestmark = [pytest.mark.timeout(60)]


def torch_client(port: int, seconds: float = 5) -> dist.TCPStore:  # type: ignore[name-defined]
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=seconds))  # type: ignore[attr-defined]


@pytest.mark.torch
def test_torch_prefix_store_on_an_rdzv_server(rdzv_server_process: int, uid: str) -> None:
    base = torch_client(rdzv_server_process)
    prefixed = dist.PrefixStore(uid, base)  # type: ignore[attr-defined]
    prefixed.set("k", "v")
    assert prefixed.get("k") == b"v"
    assert prefixed.add("n", 2) == 2
    prefixed.wait(["k"], timedelta(seconds=1))
    assert prefixed.compare_set("k", "v", "w") == b"w"
    with TCPStore("127.0.0.1", rdzv_server_process, timeout=5) as ours:
        assert ours.get(f"{uid}/k") == b"w"
        assert f"{uid}/n" in ours.list_keys()
        ours.set(f"{uid}/from-rdzv", "x")
    assert prefixed.get("from-rdzv") == b"x"


@pytest.mark.torch
def test_torch_c10d_rendezvous_backend_on_an_rdzv_server(
    rdzv_server_process: int, uid: str
) -> None:
    first = C10dRendezvousBackend(torch_client(rdzv_server_process), uid)
    second = C10dRendezvousBackend(torch_client(rdzv_server_process), uid)
    assert first.get_state() is None
    won = first.set_state(b"round-1")
    assert won is not None
    state, token, written = won
    assert (state, written) == (b"round-1", True)
    seen = second.get_state()
    assert seen is not None
    assert seen[0] == b"round-1"
    assert seen[1] == token
    # A write with the current token wins; a stale token loses and sees the winner.
    won2 = second.set_state(b"round-2", seen[1])
    assert won2 is not None
    state2, token2, written2 = won2
    assert (state2, written2) == (b"round-2", True)
    lost = first.set_state(b"stale", token)
    assert lost is not None
    assert lost[0] == b"round-2"
    assert lost[2] is False
    assert lost[1] == token2


@pytest.mark.torch
def test_torch_barrier_and_queue_on_an_rdzv_server(rdzv_server_process: int, uid: str) -> None:
    client = torch_client(rdzv_server_process)
    client.barrier(f"{uid}/bar", 1)
    client.queue_push(f"{uid}/q", b"1")
    client.queue_push(f"{uid}/q", b"2")
    assert client.queue_len(f"{uid}/q") == 2
    assert client.queue_pop(f"{uid}/q") == b"1"
    with TCPStore("127.0.0.1", rdzv_server_process, timeout=5) as ours:
        assert ours.queue_pop(f"{uid}/q") == b"2"


@pytest.mark.torch
def test_torch_worker_joins_an_rdzv_master_with_world_size() -> None:
    code = (
        "import sys, datetime, torch.distributed as dist\n"
        "s = dist.TCPStore('127.0.0.1', int(sys.argv[1]), world_size=2, is_master=False,\n"
        "                  timeout=datetime.timedelta(seconds=20))\n"
        "s.set('torch-worker', 'joined')\n"
    )
    with TCPStore("127.0.0.1", 0, is_master=True, timeout=20) as master:
        port = master.port
    # Re-host on a known port so the worker can start first and retry.
    worker = subprocess.Popen([sys.executable, "-c", code, str(port)], env=subprocess_env())
    try:
        with TCPStore("127.0.0.1", port, world_size=2, is_master=True, timeout=20) as master:
            assert worker.wait(30) == 0
            assert master.get("torch-worker") == b"joined"
            assert master.num_keys() == 2  # "init/" and "/torch-worker"
    finally:
        if worker.poll() is None:
            os.kill(worker.pid, signal.SIGKILL)
            worker.wait(10)


@pytest.mark.torch
def test_rdzv_client_on_a_torch_server(torch_server: dist.TCPStore, uid: str) -> None:  # type: ignore[name-defined]
    with TCPStore("127.0.0.1", torch_server.port, timeout=5) as ours:
        assert not ours.supports_watch
        with pytest.raises(NotImplementedError, match="not an rdzv server"):
            ours.watch(f"{uid}/k", None, 0.1)
        ours.set(f"{uid}/k", "v")
        assert torch_server.get(f"{uid}/k") == b"v"
        ours.barrier(f"{uid}/bar", 1)
    with pytest.raises(StoreAuthenticationError, match="not an rdzv server"):
        TCPStore("127.0.0.1", torch_server.port, timeout=5, auth_token="tok")


@pytest.mark.torch
def test_torch_client_cannot_use_an_authenticating_server(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    with serve_process("--auth-token-file", str(token_file)) as (_proc, port):
        with TCPStore("127.0.0.1", port, timeout=5, auth_token="s3cret") as ours:
            ours.set("secret-key", "secret-value")
        client = torch_client(port, seconds=1)
        with pytest.raises(dist.DistError):
            client.get("secret-key")


def test_rdzv_serve_starts_serves_and_stops_on_sigterm_and_sigint() -> None:
    for signum in (signal.SIGTERM, signal.SIGINT):
        with serve_process() as (proc, port):
            with TCPStore("127.0.0.1", port, timeout=5) as client:
                client.set("served", "yes")
                assert client.get("served") == b"yes"
                assert client.supports_watch
            os.kill(proc.pid, signum)
            assert proc.wait(10) == 0


def test_rdzv_serve_reports_a_bad_tls_configuration(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "rdzv.cli", "serve", "--port", "0", "--tls-cert", "x.pem"],
        check=False,
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=30,
        cwd=tmp_path,
    )
    assert result.returncode == 1
    assert "--tls-cert and --tls-key must be given together" in result.stderr


def _serve_error(*args: str, cwd: Path) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "rdzv.cli", "serve", *args],
        check=False,
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=30,
        cwd=cwd,
    )
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr  # one line, never a traceback
    return lines[0]


def test_rdzv_serve_errors_name_the_port_or_the_file(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = _serve_error("--host", "127.0.0.1", "--port", str(port), cwd=tmp_path)
        assert line == f"rdzv serve: cannot listen on 127.0.0.1:{port}: Address already in use"
    line = _serve_error("--port", "0", "--tls-cert", "c.pem", "--tls-key", "k.pem", cwd=tmp_path)
    assert line == "rdzv serve: cannot read c.pem: No such file or directory"
    line = _serve_error("--port", "0", "--auth-token-file", "missing", cwd=tmp_path)
    assert line == "rdzv serve: cannot read missing: No such file or directory"
