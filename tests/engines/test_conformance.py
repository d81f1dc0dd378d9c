"""The shared backend conformance suite (rdzv.testing) on a real etcd and a real Redis."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from rdzv.backends.base import RendezvousBackend
from rdzv.backends.etcd import EtcdRendezvousBackend
from rdzv.backends.etcd_client import EtcdClient
from rdzv.testing.conformance import CHECKS, BackendHarness, Check
from tests.engines.servers import EtcdCluster, RedisServer

pytestmark = pytest.mark.timeout(90)


class EtcdHarness(BackendHarness):
    def __init__(self, cluster: EtcdCluster) -> None:
        from rdzv.backends.etcd import parse_endpoints

        self._endpoints = parse_endpoints(cluster.endpoints)
        self._run = f"conf{uuid.uuid4().hex[:10]}"
        self._clients: list[EtcdClient] = []

    def _client(self) -> EtcdClient:
        client = EtcdClient(self._endpoints, read_timeout=10)
        self._clients.append(client)
        return client

    def connect(self) -> RendezvousBackend:
        return EtcdRendezvousBackend(self._client(), self._run, key_prefix="/conf/")

    def connect_other_run(self) -> RendezvousBackend:
        return EtcdRendezvousBackend(self._client(), self._run + "-other", key_prefix="/conf/")

    def corrupt_state(self) -> None:
        backend = EtcdRendezvousBackend(self._client(), self._run, key_prefix="/conf/")
        backend.client.put(backend.key, b"\x80garbage that is not a state")

    def close(self) -> None:
        for client in self._clients:
            client.close()


class RedisHarness(BackendHarness):
    def __init__(self, server: RedisServer) -> None:
        import redis

        self._client: Any = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=40)
        self._run = f"conf{uuid.uuid4().hex[:10]}"

    def connect(self) -> RendezvousBackend:
        from rdzv.backends.redis import RedisRendezvousBackend

        return RedisRendezvousBackend(self._client, self._run, key_prefix="conf:")

    def connect_other_run(self) -> RendezvousBackend:
        from rdzv.backends.redis import RedisRendezvousBackend

        return RedisRendezvousBackend(self._client, self._run + "-other", key_prefix="conf:")

    def corrupt_state(self) -> None:
        from rdzv.backends.redis import RedisRendezvousBackend

        key = RedisRendezvousBackend(self._client, self._run, key_prefix="conf:").key
        self._client.delete(key)
        self._client.set(key, b"garbage")

    def close(self) -> None:
        self._client.close()


@pytest.fixture(
    params=[
        pytest.param("etcd", marks=pytest.mark.etcd),
        pytest.param("redis", marks=pytest.mark.redis),
    ]
)
def harness(request: pytest.FixtureRequest) -> Iterator[BackendHarness]:
    made: BackendHarness
    if request.param == "etcd":
        made = EtcdHarness(request.getfixturevalue("etcd"))
    else:
        made = RedisHarness(request.getfixturevalue("redis_srv"))
    try:
        yield made
    finally:
        made.close()


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.name)
def test_conformance(check: Check, harness: BackendHarness) -> None:
    assert check.applies_to(harness.connect()), (
        f"{check.name} must apply: both offer every capability"
    )
    check.run(harness)
