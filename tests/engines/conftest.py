"""Fixtures for the engine tests (the etcd and Redis servers are in tests/conftest.py)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from rdzv.backends.etcd import parse_endpoints
from rdzv.backends.etcd.client import EtcdClientBase
from tests.engines.servers import EtcdCluster, RedisServer


@pytest.fixture
def unique() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def etcd_client(
    etcd: EtcdCluster, etcd_client_type: type[EtcdClientBase]
) -> Iterator[EtcdClientBase]:
    """A client of the session's etcd, of each kind in turn."""
    client = etcd_client_type(parse_endpoints(etcd.endpoints), read_timeout=10)
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
