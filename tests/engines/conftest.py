"""Fixtures for the engine tests: private etcd and Redis servers on loopback."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from rdzv.backends.etcd import EtcdRendezvousBackend, parse_endpoints
from rdzv.backends.etcd_client import EtcdClient
from tests.engines.servers import EtcdCluster, RedisServer, etcd_cluster, redis_server


@pytest.fixture(scope="session")
def etcd() -> Iterator[EtcdCluster]:
    """One single-member etcd for the whole session (tests use distinct keys)."""
    with etcd_cluster(1) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def redis_srv() -> Iterator[RedisServer]:
    """One redis-server for the whole session (tests use distinct keys)."""
    with redis_server() as server:
        yield server


@pytest.fixture
def unique() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def etcd_client(etcd: EtcdCluster) -> Iterator[EtcdClient]:
    client = EtcdClient(parse_endpoints(etcd.endpoints), read_timeout=10)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def redis_client(redis_srv: RedisServer) -> Iterator[Any]:
    import redis

    client = redis.Redis(host="127.0.0.1", port=redis_srv.port, socket_timeout=15)
    try:
        yield client
    finally:
        client.close()


BackendFactory = Callable[[str], Any]


@pytest.fixture(
    params=[
        pytest.param("etcd", marks=pytest.mark.etcd),
        pytest.param("redis", marks=pytest.mark.redis),
    ]
)
def make_backend(request: pytest.FixtureRequest) -> BackendFactory:
    """Returns ``run_id -> backend`` for a real etcd or Redis."""
    if request.param == "etcd":
        client: Any = request.getfixturevalue("etcd_client")
        return lambda run_id: EtcdRendezvousBackend(client, run_id, key_prefix="/test/")
    from rdzv.backends.redis import RedisRendezvousBackend

    redis_client = request.getfixturevalue("redis_client")
    return lambda run_id: RedisRendezvousBackend(redis_client, run_id, key_prefix="test:")
