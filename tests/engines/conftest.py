"""Fixtures for the engine tests (the etcd and Redis servers are in tests/conftest.py)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from rdzv.backends.etcd import parse_endpoints
from rdzv.backends.etcd_client import EtcdClient
from tests.engines.servers import EtcdCluster, RedisServer


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
