"""Store behaviour (torch's Store semantics) on HashStore, EtcdStore and RedisStore.

HashStore is the reference: every test passes on it, so a difference on an
engine is the engine store's bug.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from rdzv.errors import StoreTimeoutError
from rdzv.store.base import Store
from rdzv.store.memory import HashStore, PrefixStore

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(
    params=[
        "memory",
        pytest.param("etcd", marks=pytest.mark.etcd),
        pytest.param("redis", marks=pytest.mark.redis),
    ]
)
def store(request: pytest.FixtureRequest, unique: str) -> Iterator[Store]:
    made: Store
    if request.param == "memory":
        made = HashStore(timeout=5)
    elif request.param == "etcd":
        from rdzv.backends.etcd_store import EtcdStore

        made = EtcdStore(request.getfixturevalue("etcd_client"), f"/test/{unique}/", timeout=5)
    else:
        from rdzv.backends.redis_store import RedisStore

        made = RedisStore(request.getfixturevalue("redis_client"), f"test:{unique}:", timeout=5)
    try:
        yield made
    finally:
        made.close()


def later(delay: float, action: Any) -> threading.Thread:
    def run() -> None:
        time.sleep(delay)
        action()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_set_get_bytes_and_str(store: Store) -> None:
    store.set("a", "text")
    store.set("b", b"\x00\xffbin")
    assert store.get("a") == b"text"
    assert store.get("b") == b"\x00\xffbin"
    store.set("a", b"")
    assert store.get("a") == b""


def test_get_waits_for_a_later_set(store: Store) -> None:
    thread = later(0.2, lambda: store.set("late", b"v"))
    try:
        assert store.get("late") == b"v"
    finally:
        thread.join()


def test_get_times_out(store: Store) -> None:
    store.set_timeout(timedelta(seconds=0.3))
    start = time.monotonic()
    with pytest.raises(StoreTimeoutError, match="missing"):
        store.get("missing")
    assert time.monotonic() - start < 5


def test_add(store: Store) -> None:
    assert store.add("n", 5) == 5
    assert store.add("n", -2) == 3
    assert store.get("n") == b"3"
    store.set("s", b"abc")
    with pytest.raises(ValueError, match="not an integer"):
        store.add("s", 1)
    assert store.get("s") == b"abc"


def test_add_is_atomic_across_threads(store: Store) -> None:
    def work() -> None:
        for _ in range(20):
            store.add("counter", 1)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=50)
    assert store.get("counter") == b"80"


def test_compare_set_rules(store: Store) -> None:
    assert store.compare_set("k", b"", b"new") == b"new"
    assert store.compare_set("k", b"wrong", b"x") == b"new"
    assert store.compare_set("k", b"new", b"newer") == b"newer"
    assert store.compare_set("absent", b"exp", b"x") == b"exp"
    assert not store.check(["absent"])


def test_wait_check_and_wait_timeout(store: Store) -> None:
    store.set("w1", b"1")
    assert store.check(["w1"])
    assert not store.check(["w1", "w2"])
    thread = later(0.2, lambda: store.set("w2", b"2"))
    try:
        store.wait(["w1", "w2"], timedelta(seconds=5))
    finally:
        thread.join()
    with pytest.raises(StoreTimeoutError):
        store.wait(["w3"], 0.2)


def test_delete_num_list_keys(store: Store) -> None:
    base = store.num_keys()
    store.set("d1", b"1")
    store.set("d2", b"2")
    assert store.num_keys() == base + 2
    assert {"d1", "d2"} <= set(store.list_keys())
    assert store.delete_key("d1") is True
    assert store.delete_key("d1") is False
    assert store.num_keys() == base + 1
    assert "d1" not in store.list_keys()


def test_multi_get_and_set(store: Store) -> None:
    store.multi_set(["m1", "m2"], [b"a", "b"])
    assert store.multi_get(["m2", "m1"]) == [b"b", b"a"]
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        store.multi_set(["x", "y"], [b"1"])
    assert not store.check(["x"])


def test_append(store: Store) -> None:
    store.append("ap", b"ab")
    store.append("ap", "cd")
    assert store.get("ap") == b"abcd"


def test_queues(store: Store) -> None:
    assert store.queue_len("q") == 0
    store.queue_push("q", b"1")
    store.queue_push("q", "2")
    store.queue_push("q", b"3")
    assert store.queue_len("q") == 3
    assert [store.queue_pop("q") for _ in range(3)] == [b"1", b"2", b"3"]
    with pytest.raises(StoreTimeoutError):
        store.queue_pop("q", block=False)


def test_blocking_queue_pop_gets_a_later_push(store: Store) -> None:
    thread = later(0.2, lambda: store.queue_push("bq", b"item"))
    try:
        assert store.queue_pop("bq") == b"item"
    finally:
        thread.join()


def test_queue_items_go_to_exactly_one_consumer(store: Store) -> None:
    items = [f"i{n}".encode() for n in range(30)]
    for item in items:
        store.queue_push("shared", item)
    got: list[bytes] = []
    lock = threading.Lock()

    def consume() -> None:
        while True:
            try:
                item = store.queue_pop("shared", block=False)
            except StoreTimeoutError:
                return
            with lock:
                got.append(item)

    threads = [threading.Thread(target=consume) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=50)
    assert sorted(got) == sorted(items)


def test_watch(store: Store) -> None:
    assert store.supports_watch
    assert store.watch("wk", None, 0.1) is None
    thread = later(0.2, lambda: store.set("wk", b"v1"))
    try:
        assert store.watch("wk", None, 5) == b"v1"
    finally:
        thread.join()
    assert store.watch("wk", b"v0", 1) == b"v1"
    thread = later(0.2, lambda: store.delete_key("wk"))
    try:
        assert store.watch("wk", b"v1", 5) is None
    finally:
        thread.join()


def test_prefix_store_over_engine(store: Store) -> None:
    view = PrefixStore("round1", store)
    view.set("x", b"1")
    assert store.get("round1/x") == b"1"
    assert view.list_keys() == ["x"]
    assert view.add("c", 2) == 2
