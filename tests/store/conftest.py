"""Fixtures of the store tests: one Store suite over every store and server pairing."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from rdzv.store.base import Store
from rdzv.store.memory import HashStore, PrefixStore
from rdzv.store.server import TCPStoreServer
from rdzv.store.tcp import TCPStore
from tests.store.helpers import TorchClientStore, serve_process

SUITE_TIMEOUT = 5.0

StoreFactory = Callable[[], Store]


@pytest.fixture(scope="session")
def rdzv_server() -> Iterator[TCPStoreServer]:
    """An in-process rdzv server shared by the session (tests use unique keys)."""
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
    with serve_process() as (_proc, port):
        yield port


@pytest.fixture(scope="session")
def torch_server() -> Iterator[Any]:
    """torch's C++ TCPStore server, hosted in this process."""
    import torch.distributed as dist

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        yield master
    finally:
        del master


PAIRINGS = [
    "hash",
    "prefix",
    "rdzv-server+rdzv-client",
    pytest.param("rdzv-server+torch-client", marks=pytest.mark.torch),
    pytest.param("torch-server+rdzv-client", marks=pytest.mark.torch),
]


@pytest.fixture(params=PAIRINGS)
def store_factory(request: pytest.FixtureRequest) -> Iterator[StoreFactory]:
    """Make clients of one store; every client made by one factory sees the same keys."""
    kind = request.param
    if kind == "hash":
        shared: Store = HashStore(SUITE_TIMEOUT)

        def make() -> Store:
            return shared
    elif kind == "prefix":
        base = HashStore(SUITE_TIMEOUT)

        def make() -> Store:
            return PrefixStore("pre", base)
    elif kind == "rdzv-server+rdzv-client":
        port = request.getfixturevalue("rdzv_server").port

        def make() -> Store:
            return TCPStore("127.0.0.1", port, timeout=SUITE_TIMEOUT)
    elif kind == "rdzv-server+torch-client":
        port = request.getfixturevalue("rdzv_server_process")

        def make() -> Store:
            return TorchClientStore(port, SUITE_TIMEOUT)
    else:
        port = request.getfixturevalue("torch_server").port

        def make() -> Store:
            return TCPStore("127.0.0.1", port, timeout=SUITE_TIMEOUT)

    yield from closing_factory(make)


def closing_factory(make: StoreFactory) -> Iterator[StoreFactory]:
    """Yield a factory wrapping ``make`` that closes every store it made afterwards."""
    made: list[Store] = []

    def tracked() -> Store:
        store = make()
        made.append(store)
        return store

    try:
        yield tracked
    finally:
        for store in made:
            store.close()


@pytest.fixture
def store(store_factory: StoreFactory) -> Store:
    """One client of the store under test."""
    return store_factory()


@pytest.fixture
def uid() -> str:
    """A prefix that keeps this test's keys apart from other tests' on shared servers."""
    return uuid.uuid4().hex[:12]
