"""The Store suite (rdzv.testing.store_conformance) on every store: one harness and one test each.

HashStore; PrefixStore over a HashStore; the four server/client pairings
(rdzv's or torch's server with rdzv's or torch's client; torch with torch is
the reference that shows the suite asks for torch's semantics); EtcdStore
and RedisStore. Then the suite's own checks: its runner, its capability
skips, and that it catches a store that breaks the rules.
"""

from __future__ import annotations

import unittest
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from rdzv.backends.etcd import parse_endpoints
from rdzv.backends.etcd.client import EtcdClientBase
from rdzv.backends.etcd.store import EtcdStore
from rdzv.backends.redis.store import RedisStore
from rdzv.store.base import Store, Timeout, Value
from rdzv.store.file import FileStore
from rdzv.store.memory import HashStore, PrefixStore
from rdzv.store.tcp import TCPStore
from rdzv.testing.conformance import ConformanceError
from rdzv.testing.store_conformance import (
    STORE_CHECKS,
    StoreCapability,
    StoreCheck,
    StoreHarness,
    run_store_conformance,
)
from tests.engines.servers import EtcdCluster, RedisServer
from tests.store.helpers import torch_client

pytestmark = pytest.mark.timeout(60)

EACH_CHECK = pytest.mark.parametrize("check", STORE_CHECKS, ids=lambda c: c.name)

TIMEOUT = 5.0
EVERY = frozenset(StoreCapability)
WATCH_ONLY = frozenset({StoreCapability.WATCH})
QUEUE_KEY = frozenset({StoreCapability.QUEUE_KEY})
# The rest of torch's Store API: its queues and delete_key's answer (torch's
# FileStore has neither).
TORCH_API = frozenset({StoreCapability.QUEUES, StoreCapability.DELETE_RESULT})
FILE = WATCH_ONLY | TORCH_API


class Clients(StoreHarness):
    """Clients of one store, each made by ``make``; all are closed at the end."""

    def __init__(self, make: Callable[[], Store], capabilities: frozenset[StoreCapability]) -> None:
        self._make = make
        self.capabilities = capabilities
        self._made: list[Store] = []

    def connect(self) -> Store:
        store = self._make()
        self._made.append(store)
        return store

    def close(self) -> None:
        for store in self._made:
            store.close()


def run(check: StoreCheck, harness: StoreHarness) -> None:
    try:
        check.run(harness)
    finally:
        harness.close()


# -- in memory ---------------------------------------------------------------


def hash_store() -> Clients:
    shared = HashStore(TIMEOUT)
    return Clients(lambda: shared, EVERY)


@EACH_CHECK
def test_hash_store(check: StoreCheck) -> None:
    run(check, hash_store())


@EACH_CHECK
def test_prefix_store(check: StoreCheck) -> None:
    base = HashStore(TIMEOUT)
    run(check, Clients(lambda: PrefixStore("pre", base), EVERY))


# -- one file, no server ----------------------------------------------------


@pytest.mark.parametrize(
    "check",
    [c for c in STORE_CHECKS if c.capability is None or c.capability in FILE],
    ids=lambda c: c.name,
)
def test_file_store(check: StoreCheck, tmp_path: Path) -> None:
    # Every client opens the file on its own, as separate processes would. A
    # client serialises its calls (a blocking wait holds it), like the TCP client.
    path = tmp_path / "store"
    run(check, Clients(lambda: FileStore(path, timeout=TIMEOUT), FILE))


# -- server/client pairings --------------------------------------------------


# (server, client) -> what the pairing offers; torch's side watches nothing.
PAIRINGS = {
    ("rdzv", "rdzv"): WATCH_ONLY | QUEUE_KEY | TORCH_API,
    ("rdzv", "torch"): QUEUE_KEY | TORCH_API,
    ("torch", "rdzv"): QUEUE_KEY | TORCH_API,
    ("torch", "torch"): QUEUE_KEY | TORCH_API,
}


class PairingHarness(Clients):
    def __init__(self, server: str, client: str, request: pytest.FixtureRequest) -> None:
        if server == "rdzv":
            # torch's client cannot use a Python server in its own process (the GIL).
            fixture = "rdzv_server" if client == "rdzv" else "rdzv_server_process"
            found = request.getfixturevalue(fixture)
            port: int = found if isinstance(found, int) else found.port
        else:
            port = request.getfixturevalue("torch_server").port

        def make() -> Store:
            if client == "rdzv":
                return TCPStore("127.0.0.1", port, timeout=TIMEOUT)
            return torch_client(port, TIMEOUT)

        super().__init__(make, PAIRINGS[server, client])


@pytest.mark.parametrize(
    ("server", "client", "check"),
    [
        pytest.param(
            server,
            client,
            check,
            id=f"{server}-server+{client}-client-{check.name}",
            marks=[pytest.mark.torch] if "torch" in (server, client) else [],
        )
        for (server, client), capabilities in PAIRINGS.items()
        for check in STORE_CHECKS
        if check.capability is None or check.capability in capabilities
    ],
)
def test_tcp_pairing(
    server: str, client: str, check: StoreCheck, request: pytest.FixtureRequest
) -> None:
    run(check, PairingHarness(server, client, request))


# -- engines -----------------------------------------------------------------


@pytest.mark.etcd
@EACH_CHECK
def test_etcd_store(
    check: StoreCheck, etcd: EtcdCluster, etcd_client_type: type[EtcdClientBase]
) -> None:
    endpoints, prefix = parse_endpoints(etcd.endpoints), f"/suite/{uuid.uuid4().hex[:10]}/"

    def make() -> Store:
        client = etcd_client_type(endpoints, read_timeout=10)
        return EtcdStore(client, prefix, TIMEOUT, owns_client=True)

    run(check, Clients(make, EVERY - QUEUE_KEY))


@pytest.mark.redis
@EACH_CHECK
def test_redis_store(check: StoreCheck, redis_srv: RedisServer) -> None:
    import redis

    prefix = f"suite:{uuid.uuid4().hex[:10]}:"

    def make() -> Store:
        client = redis.Redis(host="127.0.0.1", port=redis_srv.port, socket_timeout=15)
        return RedisStore(client, prefix, TIMEOUT, owns_client=True)

    run(check, Clients(make, EVERY - QUEUE_KEY))


# -- the suite itself --------------------------------------------------------


@pytest.mark.slow
def test_run_store_conformance_runs_every_check() -> None:
    assert run_store_conformance(hash_store) == [c.name for c in STORE_CHECKS]


class NoWatchStore(HashStore):
    """A HashStore without watch, as a store without it looks (the polling fallbacks)."""

    @property
    def supports_watch(self) -> bool:
        return False

    def watch(self, key: str, previous: bytes | None, timeout: Timeout) -> bytes | None:
        return Store.watch(self, key, previous, timeout)


def no_watch_store(capabilities: frozenset[StoreCapability] = EVERY - WATCH_ONLY) -> Clients:
    shared = NoWatchStore(TIMEOUT)
    return Clients(lambda: shared, capabilities)


@pytest.mark.slow
def test_checks_of_a_missing_capability_are_skipped() -> None:
    ran = run_store_conformance(no_watch_store)
    assert {c.name for c in STORE_CHECKS} - set(ran) == {"watch"}
    watch = next(c for c in STORE_CHECKS if c.name == "watch")
    with pytest.raises(unittest.SkipTest, match="does not offer watch"):
        watch.run(no_watch_store())


@pytest.mark.slow
def test_a_store_must_advertise_what_the_harness_says() -> None:
    with pytest.raises(ConformanceError, match="watch_advertised: supports_watch must be True"):
        run_store_conformance(lambda: no_watch_store(EVERY))


class _CreatingCompareSet(HashStore):
    """Creates a missing key whatever ``expected`` is: against torch's rule."""

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        if not self.check([key]):
            self.set(key, desired)
        return super().compare_set(key, expected, desired)


def test_suite_catches_a_store_that_breaks_compare_set() -> None:
    broken = _CreatingCompareSet(TIMEOUT)
    with pytest.raises(ConformanceError, match="compare_set: missing key, expected set"):
        run_store_conformance(lambda: Clients(lambda: broken, EVERY))
