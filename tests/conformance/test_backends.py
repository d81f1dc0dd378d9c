"""The backend suite (rdzv.testing.conformance) on every backend: one harness and one test each.

memory, c10d on a HashStore (with its watch, and polling with the watch
hidden), c10d over TCP, etcd and Redis; then the suite's own checks: its
runner, and that it catches a backend that ignores tokens.
"""

from __future__ import annotations

import unittest
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rdzv.backends.base import RendezvousBackend, VerdictBackend
from rdzv.backends.etcd import EtcdRendezvousBackend, parse_endpoints
from rdzv.backends.etcd.client import EtcdClientBase
from rdzv.backends.kv import StoreVerdict
from rdzv.backends.redis import RedisRendezvousBackend
from rdzv.backends.store import C10dRendezvousBackend
from rdzv.errors import RendezvousConnectionError
from rdzv.store.base import Store
from rdzv.store.file import FileStore
from rdzv.store.foreign import StoreLike, as_store
from rdzv.store.memory import HashStore
from rdzv.store.tcp import TCPStore
from rdzv.testing import InMemoryBackend, InMemoryRendezvousStorage
from rdzv.testing.conformance import BACKEND_CHECKS, BackendHarness, Check, run_conformance
from tests.conformance.test_stores import NoWatchStore
from tests.engines.servers import EtcdCluster, RedisServer

pytestmark = pytest.mark.timeout(90)

EACH_CHECK = pytest.mark.parametrize("check", BACKEND_CHECKS, ids=lambda c: c.name)


def run_all(check: Check, harness: BackendHarness, verdict: bool = False) -> None:
    """Run ``check``, which must apply: these backends offer every capability.

    Only etcd and Redis keep a round's verdict beside the state; the others
    keep it in the handler's store.
    """
    if check.capability is VerdictBackend and not verdict:
        assert not check.applies_to(harness.connect())
        return
    assert check.applies_to(harness.connect()), f"{check.name} must apply"
    check.run(harness)


# -- memory ------------------------------------------------------------------


class MemoryHarness(BackendHarness):
    def __init__(self) -> None:
        self.storage = InMemoryRendezvousStorage()

    def connect(self) -> RendezvousBackend:
        return InMemoryBackend(self.storage)

    def connect_other_run(self) -> RendezvousBackend | None:
        return InMemoryBackend(InMemoryRendezvousStorage())

    def corrupt_state(self) -> None:
        self.storage.corrupt_state()


@EACH_CHECK
def test_memory(check: Check) -> None:
    harness = MemoryHarness()
    try:
        run_all(check, harness)
    finally:
        harness.close()


# -- c10d over a Store -------------------------------------------------------


class C10dHarness(BackendHarness):
    """c10d backends on ``store`` (or on clients ``client`` makes of it), run ``run1``.

    A client may be any store the backend takes (torch's too: tests/torchcompat).
    """

    def __init__(self, store: Store, client: Callable[[], StoreLike] | None = None) -> None:
        self.store = store
        self.client = client
        self.clients: list[StoreLike] = []

    def _client(self) -> StoreLike:
        if self.client is None:
            return self.store
        store = self.client()
        self.clients.append(store)
        return store

    def connect(self) -> RendezvousBackend:
        return C10dRendezvousBackend(self._client(), "run1")

    def connect_other_run(self) -> RendezvousBackend:
        return C10dRendezvousBackend(self._client(), "run2")

    def corrupt_state(self) -> None:
        key = "rdzv.backend/run1/state"
        self.store.set(key, b"\x80\x04garbage")
        # torch's SET has no reply: a read on the same connection makes sure
        # the server applied it before other connections look.
        assert self.store.get(key) == b"\x80\x04garbage"

    def close(self) -> None:
        for store in self.clients:
            as_store(store).close()
        self.store.close()


@pytest.mark.parametrize("watch", [True, False], ids=["watch", "poll"])
@EACH_CHECK
def test_c10d_on_hash_store(check: Check, watch: bool) -> None:
    harness = C10dHarness(HashStore(timeout=10) if watch else NoWatchStore(timeout=10))
    try:
        run_all(check, harness)
    finally:
        harness.close()


@EACH_CHECK
def test_c10d_on_tcp(check: Check) -> None:
    host = TCPStore("127.0.0.1", 0, is_master=True, timeout=10)
    harness = C10dHarness(host, lambda: TCPStore("127.0.0.1", host.port, timeout=10))
    try:
        run_all(check, harness)
    finally:
        harness.close()


@EACH_CHECK
def test_c10d_on_a_file(check: Check, tmp_path: Path) -> None:
    # Every client opens the file on its own, as separate processes would.
    path = tmp_path / "store"
    harness = C10dHarness(FileStore(path, timeout=10), lambda: FileStore(path, timeout=10))
    try:
        run_all(check, harness)
    finally:
        harness.close()


class StoreVerdictBackend(C10dRendezvousBackend, VerdictBackend):
    """c10d with the verdicts a handler gives it: in its store, a write told by the token."""

    def __init__(self, store: StoreLike, run_id: str) -> None:
        super().__init__(store, run_id)
        self._verdicts = StoreVerdict(self.store, f"{run_id}/", self._changed, 0.05)

    def _changed(self, token: object) -> bool:
        return bool(self.read_token() != token)

    def set_verdict(self, round_id: int) -> None:
        self._verdicts.set_verdict(round_id)

    def wait_for_verdict(self, round_id: int, token: Any, timeout: float) -> bool | None:
        return self._verdicts.wait_for_verdict(round_id, token, timeout)

    def drop_verdict(self, round_id: int) -> None:
        self._verdicts.drop_verdict(round_id)


class StoreVerdictHarness(C10dHarness):
    def connect(self) -> RendezvousBackend:
        return StoreVerdictBackend(self._client(), "run1")


@pytest.mark.parametrize("watch", [True, False], ids=["watch", "poll"])
def test_the_handlers_verdicts_in_a_store_keep_the_verdict_rules(watch: bool) -> None:
    # The adapter the handler builds for a backend without verdicts
    # (rdzv.backends.kv.StoreVerdict) keeps the rules an engine's own keep.
    (check,) = (c for c in BACKEND_CHECKS if c.capability is VerdictBackend)
    harness = StoreVerdictHarness(HashStore(timeout=10) if watch else NoWatchStore(timeout=10))
    try:
        check.run(harness)
    finally:
        harness.close()


# -- etcd --------------------------------------------------------------------


class EtcdHarness(BackendHarness):
    def __init__(self, cluster: EtcdCluster, client_type: type[EtcdClientBase]) -> None:
        self._endpoints = parse_endpoints(cluster.endpoints)
        self._run = f"conf{uuid.uuid4().hex[:10]}"
        self._client_type = client_type
        self._clients: list[EtcdClientBase] = []

    def _backend(self, run: str) -> EtcdRendezvousBackend:
        client = self._client_type(self._endpoints, read_timeout=10)
        self._clients.append(client)
        return EtcdRendezvousBackend(client, run, key_prefix="/conf/")

    def connect(self) -> RendezvousBackend:
        return self._backend(self._run)

    def connect_other_run(self) -> RendezvousBackend:
        return self._backend(self._run + "-other")

    def corrupt_state(self) -> None:
        backend = self._backend(self._run)
        backend.client.put(backend.key, b"\x80garbage that is not a state")

    def close(self) -> None:
        for client in self._clients:
            client.close()


@pytest.mark.etcd
@EACH_CHECK
def test_etcd(check: Check, etcd: EtcdCluster, etcd_client_type: type[EtcdClientBase]) -> None:
    harness = EtcdHarness(etcd, etcd_client_type)
    try:
        run_all(check, harness, verdict=True)
    finally:
        harness.close()


# -- Redis -------------------------------------------------------------------


class RedisHarness(BackendHarness):
    def __init__(self, server: RedisServer) -> None:
        import redis

        self._client: Any = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=40)
        self._run = f"conf{uuid.uuid4().hex[:10]}"

    def _backend(self, run: str) -> RedisRendezvousBackend:
        return RedisRendezvousBackend(self._client, run, key_prefix="conf:")

    def connect(self) -> RendezvousBackend:
        return self._backend(self._run)

    def connect_other_run(self) -> RendezvousBackend:
        return self._backend(self._run + "-other")

    def corrupt_state(self) -> None:
        key = self._backend(self._run).key
        self._client.delete(key)
        self._client.set(key, b"garbage")

    def close(self) -> None:
        self._client.close()


@pytest.mark.redis
@EACH_CHECK
def test_redis(check: Check, redis_srv: RedisServer) -> None:
    harness = RedisHarness(redis_srv)
    try:
        run_all(check, harness, verdict=True)
    finally:
        harness.close()


# -- the suite itself --------------------------------------------------------


def test_run_conformance_runs_every_check() -> None:
    # The in-memory backend keeps its verdicts in the handler's store.
    expected = [c.name for c in BACKEND_CHECKS if c.capability is not VerdictBackend]
    assert run_conformance(MemoryHarness) == expected


class _SingleRunHarness(MemoryHarness):
    def connect_other_run(self) -> None:
        return None


def test_checks_needing_a_second_run_are_skipped_without_one() -> None:
    ran = run_conformance(_SingleRunHarness)
    assert set(run_conformance(MemoryHarness)) - set(ran) == {
        "fencing_token_on_empty_run",
        "runs_isolated",
    }


def test_a_check_that_does_not_apply_raises_skiptest() -> None:
    check = next(c for c in BACKEND_CHECKS if c.name == "runs_isolated")
    with pytest.raises(unittest.SkipTest, match="second run"):
        check.run(_SingleRunHarness())


class _BrokenBackend(InMemoryBackend):
    def set_state(self, state: bytes, token: object = None) -> tuple[bytes, object, bool] | None:
        result = super().get_state()
        # Ignores the token: a lost-update bug the suite must catch.
        if result is None:
            return super().set_state(state, None)
        return super().set_state(state, result[1])


class BrokenHarness(MemoryHarness):
    def connect(self) -> RendezvousBackend:
        return _BrokenBackend(self.storage)


def test_suite_catches_a_backend_that_ignores_tokens() -> None:
    with pytest.raises(AssertionError, match=r"fencing_create: .* must not write"):
        run_conformance(BrokenHarness)


def test_fail_next_injects_connection_errors() -> None:
    storage = InMemoryRendezvousStorage()
    backend = InMemoryBackend(storage)
    storage.fail_next(2)
    for _ in range(2):
        with pytest.raises(RendezvousConnectionError):
            backend.get_state()
    assert backend.get_state() is None
