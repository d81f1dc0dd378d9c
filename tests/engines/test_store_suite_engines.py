"""The store helper's shared Store suite (tests/store) run on EtcdStore and RedisStore.

The suite's tests (and its ``store``/``uid`` fixtures) are imported here and
collected again with this module's ``store_factory``: every client one
factory makes shares the same engine keyspace, each with its own client
connection.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from rdzv.store.base import Store
from tests.store.conftest import SUITE_TIMEOUT, StoreFactory, closing_factory, store, uid
from tests.store.test_store_suite import (
    test_add,
    test_add_to_a_non_integer_fails,
    test_append,
    test_check,
    test_compare_set_rules,
    test_delete_key,
    test_get_missing_times_out_then_store_still_works,
    test_get_waits_for_a_set_by_another_client,
    test_keys_with_odd_characters,
    test_list_keys,
    test_multi_get_times_out_on_a_missing_key,
    test_multi_set_and_multi_get,
    test_num_keys_counts_sets_and_deletes,
    test_queue_fifo_and_len,
    test_queue_pop_blocking_times_out,
    test_queue_pop_blocks_until_a_push,
    test_queue_pop_empty_without_blocking_raises,
    test_set_get_str_and_bytes,
    test_try_multi_get,
    test_wait_returns_when_keys_exist,
    test_wait_timeout_accepts_seconds,
    test_wait_timeout_and_cancel_leave_the_connection_usable,
    test_watch,
)

__all__ = [
    "store",
    "test_add",
    "test_add_to_a_non_integer_fails",
    "test_append",
    "test_check",
    "test_compare_set_rules",
    "test_delete_key",
    "test_get_missing_times_out_then_store_still_works",
    "test_get_waits_for_a_set_by_another_client",
    "test_keys_with_odd_characters",
    "test_list_keys",
    "test_multi_get_times_out_on_a_missing_key",
    "test_multi_set_and_multi_get",
    "test_num_keys_counts_sets_and_deletes",
    "test_queue_fifo_and_len",
    "test_queue_pop_blocking_times_out",
    "test_queue_pop_blocks_until_a_push",
    "test_queue_pop_empty_without_blocking_raises",
    "test_set_get_str_and_bytes",
    "test_try_multi_get",
    "test_wait_returns_when_keys_exist",
    "test_wait_timeout_accepts_seconds",
    "test_wait_timeout_and_cancel_leave_the_connection_usable",
    "test_watch",
    "uid",
]


@pytest.fixture(
    params=[
        pytest.param("etcd", marks=pytest.mark.etcd),
        pytest.param("redis", marks=pytest.mark.redis),
    ]
)
def store_factory(request: pytest.FixtureRequest) -> Iterator[StoreFactory]:
    prefix = uuid.uuid4().hex[:10]
    if request.param == "etcd":
        from rdzv.backends.etcd import parse_endpoints
        from rdzv.backends.etcd_client import EtcdClient
        from rdzv.backends.etcd_store import EtcdStore

        endpoints = parse_endpoints(request.getfixturevalue("etcd").endpoints)

        def make() -> Store:
            client = EtcdClient(endpoints, read_timeout=10)
            return EtcdStore(client, f"/suite/{prefix}/", SUITE_TIMEOUT, owns_client=True)
    else:
        import redis

        from rdzv.backends.redis_store import RedisStore

        port = request.getfixturevalue("redis_srv").port

        def make() -> Store:
            client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=15)
            return RedisStore(client, f"suite:{prefix}:", SUITE_TIMEOUT, owns_client=True)

    yield from closing_factory(make)
