"""Shared pytest configuration and fixtures.

The servers are session-wide and started on first use; tests keep apart by
using keys of their own.

Tests marked ``slow`` (multi-host jobs in network namespaces, chaos runs,
torch jobs, multi-process tests, doc commands, and any test that takes
more than about two seconds) are left out of the fast tier,
``python -m pytest -n 2 --dist loadgroup -m "not slow"``; ``bash
scripts/test`` runs them all.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import settings

from rdzv.dynamic.handler import DynamicRendezvousHandler

settings.register_profile("thorough", max_examples=1000)
"""``HYPOTHESIS_PROFILE=thorough`` explores ten times the default 100 examples
wherever a test does not fix its own count (tests/dynamic/test_interleavings.py)."""
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

if TYPE_CHECKING:
    from rdzv.backends.etcd.client import EtcdClientBase
    from rdzv.store.server import TCPStoreServer
    from tests.certs import TLSFiles
    from tests.engines.servers import EtcdCluster, RedisServer


@pytest.fixture(scope="session", autouse=True)
def _children_tmpdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Child processes keep their temporary files under pytest's base temp.

    An agent that a test SIGKILLs cannot remove its scratch directory
    (``rdzv-run-*``): each suite run left about ten of them in /tmp, which
    pytest's own retention now removes with the base temp.
    """
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("children"))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before


@pytest.fixture
def handlers() -> Iterator[list[DynamicRendezvousHandler]]:
    """Handlers a test made (append them): stopped and their clients closed afterwards."""
    made: list[DynamicRendezvousHandler] = []
    try:
        yield made
    finally:
        for handler in made:
            handler.pre_shutdown()
        for handler in made:
            handler.close()


@pytest.fixture
def make_server() -> Iterator[type[TCPStoreServer]]:
    """A TCPStoreServer class whose started servers are stopped after the test."""
    from rdzv.store.server import TCPStoreServer

    started: list[TCPStoreServer] = []

    class Tracked(TCPStoreServer):
        def start(self) -> TCPStoreServer:
            started.append(self)
            return super().start()

    try:
        yield Tracked
    finally:
        for server in started:
            server.stop()


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    """A CA with server and client certificates (and a second CA), made once per test module."""
    from tests.certs import make_tls_files

    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="session")
def etcd() -> Iterator[EtcdCluster]:
    """One single-member etcd for the whole session."""
    from tests.engines.servers import etcd_cluster

    with etcd_cluster(1) as cluster:
        yield cluster


@pytest.fixture(params=["gateway", "grpc"])
def etcd_client_type(request: pytest.FixtureRequest) -> type[EtcdClientBase]:
    """Each etcd client in turn: the gateway's (standard library) and gRPC's (the etcd extra)."""
    from rdzv.backends.etcd.gateway import EtcdClient
    from rdzv.backends.etcd.grpc import EtcdGrpcClient

    return EtcdClient if request.param == "gateway" else EtcdGrpcClient


@pytest.fixture(scope="session")
def redis_srv() -> Iterator[RedisServer]:
    """One redis-server for the whole session."""
    from tests.engines.servers import redis_server

    with redis_server() as server:
        yield server


@pytest.fixture(scope="session")
def rdzv_server() -> Iterator[TCPStoreServer]:
    """An in-process rdzv store server for the whole session."""
    from rdzv.store.server import TCPStoreServer

    server = TCPStoreServer("127.0.0.1", 0).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def rdzv_server_process() -> Iterator[int]:
    """An ``rdzv serve`` subprocess; yields its port.

    torch's client keeps the GIL during some calls (``list_keys``), so it
    cannot use a Python server hosted in its own process.
    """
    from tests.store.helpers import serve_process

    with serve_process() as (_proc, port):
        yield port


@pytest.fixture
def torch_events(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict[str, Any]]]:
    """The rendezvous events torch records, each as its JSON object, while the test runs.

    A capturing handler is torch's ``dynamic_rendezvous`` event handler
    meanwhile (a ``NullHandler`` otherwise, which records nothing).
    """
    import json
    import logging

    from torch.distributed.elastic import events
    from torch.distributed.elastic.events import handlers

    recorded: list[dict[str, Any]] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            recorded.append(json.loads(record.getMessage()))

    capture = Capture()
    monkeypatch.setitem(handlers._log_handlers, "dynamic_rendezvous", capture)
    monkeypatch.delitem(events._events_loggers, "dynamic_rendezvous", raising=False)
    yield recorded
    logging.getLogger("torchelastic-events-dynamic_rendezvous").removeHandler(capture)
    events._events_loggers.pop("dynamic_rendezvous", None)


@pytest.fixture(scope="session")
def torch_server() -> Iterator[Any]:
    """torch's C++ TCPStore server, hosted in this process."""
    import torch.distributed as dist

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    try:
        yield master
    finally:
        del master
