"""Shared pytest configuration and fixtures.

The servers are session-wide and started on first use; tests keep apart by
using keys of their own.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from rdzv.dynamic.handler import DynamicRendezvousHandler

if TYPE_CHECKING:
    from tests.engines.servers import EtcdCluster, RedisServer


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


@pytest.fixture(scope="session")
def etcd() -> Iterator[EtcdCluster]:
    """One single-member etcd for the whole session."""
    from tests.engines.servers import etcd_cluster

    with etcd_cluster(1) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def redis_srv() -> Iterator[RedisServer]:
    """One redis-server for the whole session."""
    from tests.engines.servers import redis_server

    with redis_server() as server:
        yield server
