"""etcd, Redis and TCP store calls end by their caller's deadline, whatever the server does.

Each test runs a real handler against a real server started for it (or a
loopback port nobody listens on), then makes the server stop answering:
nothing listening, or the process paused with SIGSTOP (the kernel still
accepts connections, nothing replies). The bounds asserted are generous for
a loaded machine, and far below the 60 s read timeout the etcd and Redis
calls took before they honoured the caller's deadline, and the
:data:`STORE_TIMEOUT` plus grace the TCP store's did (``c10d``: the handler
over ``rdzv serve``, whose client connects when it is built, so the test of
a server nobody listens on is not for it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from rdzv.api import RendezvousParameters, RendezvousTimeout
from rdzv.backends.base import RendezvousBackend
from rdzv.backends.etcd import EtcdRendezvousBackend, create_client
from rdzv.backends.etcd.store import EtcdStore
from rdzv.backends.options import EtcdOptions, RedisOptions
from rdzv.backends.store import C10dRendezvousBackend
from rdzv.dynamic.handler import DynamicRendezvousHandler
from rdzv.dynamic.keepalive import CALL_GRACE
from rdzv.errors import RendezvousConnectionError, RendezvousError, RendezvousTimeoutError
from rdzv.store.base import Store
from rdzv.store.tcp import TCPStore
from tests.engines.servers import etcd_cluster, kill_process, redis_server
from tests.procs import free_port, subprocess_env
from tests.store.helpers import serve_process

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

JOIN = 3.0
"""The join timeout of every handler here."""
SLACK = 12.0
"""Scheduling slack on a loaded two-core machine; still far below the old 60 s."""
CONNECT = 5.0
"""The etcd client's connect timeout (its default)."""
INTERVAL = 0.5
ATTEMPTS = 3
STORE_TIMEOUT = 30.0
"""The TCP store's timeout: a reply it waited for in full would pass every bound here."""


def _backend(kind: str, endpoint: str) -> tuple[RendezvousBackend, Store]:
    """Build a backend without checking that the server answers."""
    if kind == "c10d":
        host, port = endpoint.rsplit(":", 1)
        tcp = TCPStore(host, int(port), timeout=STORE_TIMEOUT)
        return C10dRendezvousBackend(tcp, "deadlines", liveness_store=tcp.clone()), tcp
    params = RendezvousParameters(kind, endpoint, "deadlines", 1, 1)
    if kind == "etcd":
        etcd = EtcdOptions.from_params(params)
        backend = EtcdRendezvousBackend(create_client(etcd), etcd.run_id, owns_client=True)
        return backend, EtcdStore(backend.client, backend.run_prefix + b"store/")
    from rdzv.backends.redis import RedisRendezvousBackend
    from rdzv.backends.redis.connection import create_client as redis_client
    from rdzv.backends.redis.store import RedisStore

    options = RedisOptions.from_params(params)
    client = redis_client(options)
    redis_backend = RedisRendezvousBackend(client, options.run_id, owns_client=True)
    return redis_backend, RedisStore(client, f"{redis_backend.key}:store:")


def _handler(kind: str, endpoint: str) -> DynamicRendezvousHandler:
    backend, store = _backend(kind, endpoint)
    return DynamicRendezvousHandler.from_backend(
        "deadlines",
        store,
        backend,
        1,
        1,
        "127.0.0.1",
        timeout=RendezvousTimeout(join=JOIN, last_call=0.1, close=2.0),
        keep_alive_interval=INTERVAL,
        keep_alive_max_attempt=ATTEMPTS,
    )


def _timed(call: Callable[[], Any]) -> tuple[float, BaseException | None]:
    started = time.monotonic()
    try:
        call()
    except RendezvousError as exc:
        return time.monotonic() - started, exc
    return time.monotonic() - started, None


@contextmanager
def _server(kind: str) -> Iterator[tuple[str, subprocess.Popen[Any]]]:
    if kind == "c10d":
        with serve_process() as (serve, port):
            yield f"127.0.0.1:{port}", serve
    elif kind == "etcd":
        with etcd_cluster(1) as cluster:
            proc = cluster.members[0].proc
            assert proc is not None
            yield cluster.endpoint, proc
    else:
        with redis_server() as server:
            assert server.proc is not None
            yield server.endpoint, server.proc


@contextmanager
def _paused(proc: subprocess.Popen[Any]) -> Iterator[None]:
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(proc.pid, signal.SIGCONT)


@pytest.mark.parametrize("kind", ["etcd", "redis"])
def test_a_server_nobody_listens_on_costs_the_join_timeout_then_the_connect_timeout(
    kind: str,
) -> None:
    handler = _handler(kind, f"127.0.0.1:{free_port()}")
    try:
        took, error = _timed(handler.next_rendezvous)
        assert isinstance(error, RendezvousConnectionError), error
        assert took < JOIN + SLACK, took
        for call in (handler.is_closed, handler.num_nodes_waiting):
            took, error = _timed(call)
            assert isinstance(error, RendezvousConnectionError), error
            assert took < CONNECT + SLACK, (call, took)
        took, _ = _timed(handler.shutdown)
        assert took < 5.0 + SLACK, took
    finally:
        handler.close()


@pytest.mark.parametrize("kind", ["etcd", "redis", "c10d"])
def test_a_paused_server_costs_each_call_its_own_deadline(kind: str) -> None:
    with _server(kind) as (endpoint, proc):
        handler = _handler(kind, endpoint)
        try:
            assert handler.next_rendezvous().world_size == 1
            with _paused(proc):
                took, error = _timed(handler.next_rendezvous)
                assert isinstance(error, RendezvousConnectionError), error
                assert took < JOIN + SLACK, took
                took, error = _timed(handler.set_closed)
                assert isinstance(error, (RendezvousTimeoutError, RendezvousConnectionError))
                assert took < 2.0 + SLACK, took
                took, _ = _timed(handler.shutdown)
                assert took < 5.0 + SLACK, took
        finally:
            handler.close()


@pytest.mark.parametrize("kind", ["etcd", "redis", "c10d"])
def test_the_keep_alive_gives_up_on_a_paused_server_within_its_attempts(kind: str) -> None:
    with _server(kind) as (endpoint, proc):
        handler = _handler(kind, endpoint)
        try:
            assert handler.next_rendezvous().world_size == 1
            with _paused(proc):
                started = time.monotonic()
                while (
                    handler.statistics().keepalive_error is None and time.monotonic() - started < 60
                ):
                    time.sleep(0.05)
                took = time.monotonic() - started
            assert handler.statistics().keepalive_error is not None
            # the beats of the failure streak share interval x attempts + CALL_GRACE
            assert took < INTERVAL * ATTEMPTS + CALL_GRACE + SLACK, took
        finally:
            handler.close()


@pytest.mark.parametrize("kind", ["etcd", "redis"])
def test_sigterm_ends_rdzv_run_within_the_stop_grace_while_the_server_is_paused(
    kind: str,
) -> None:
    grace = 2.0
    with _server(kind) as (endpoint, proc):
        run = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rdzv",
                "run",
                *("--nnodes", "1", "--rdzv-backend", kind, "--rdzv-endpoint", endpoint),
                *("--rdzv-id", "sigterm", "--stop-grace", str(grace), "--no-python"),
                *("sleep", "120"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=subprocess_env(),
        )
        try:
            assert run.stderr is not None
            while b"starting workers" not in run.stderr.readline():  # bounded by the test timeout
                assert run.poll() is None, "rdzv run ended before starting its workers"
            with _paused(proc):
                started = time.monotonic()
                run.send_signal(signal.SIGTERM)
                code = run.wait(60)
                took = time.monotonic() - started
            assert code == 128 + signal.SIGTERM
            assert took < grace + 5.0 + SLACK, took
        finally:
            kill_process(run)
            if run.stderr is not None:
                run.stderr.close()
