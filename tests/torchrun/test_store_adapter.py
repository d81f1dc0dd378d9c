"""The torch ``Store`` adapter over rdzv stores (``rdzv.torch.as_torch_store``), used by
the ``rdzv`` torchrun backend when the store needs a secret or TLS (torch's own client
speaks neither) or is a file."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

from rdzv.store.memory import HashStore, PrefixStore
from rdzv.store.server import TCPStoreServer
from rdzv.store.tcp import TCPStore

torch_dist = pytest.importorskip("torch.distributed")
store_util = pytest.importorskip("torch.distributed.elastic.utils.store")

from rdzv.torch import as_torch_store  # noqa: E402 - after the torch check

pytestmark = [pytest.mark.torch, pytest.mark.timeout(60)]


def test_the_calls_torchs_agent_makes_reach_the_rdzv_store() -> None:
    inner = PrefixStore("round/3", HashStore(timeout=5))
    adapter = as_torch_store(inner)
    assert adapter.timeout == timedelta(seconds=5)  # type: ignore[attr-defined]  # the rdzv store's timeout at first
    adapter.set("role/0", b"info")  # type: ignore[arg-type]
    assert inner.get("role/0") == b"info"
    assert adapter.get("role/0") == b"info"
    adapter.multi_set(["ranks/0", "ranks/1"], ["[0, 2]", "[2, 2]"])  # type: ignore[attr-defined]
    assert adapter.multi_get(["ranks/0", "ranks/1"]) == [b"[0, 2]", b"[2, 2]"]
    assert adapter.add("count", 2) == 2
    assert adapter.check(["count", "role/0"])
    assert not adapter.check(["absent"])
    assert adapter.compare_set("cas", "", "v1") == b"v1"
    adapter.append("log", "a")  # type: ignore[attr-defined]
    adapter.append("log", "b")  # type: ignore[attr-defined]
    assert inner.get("log") == b"ab"
    assert adapter.delete_key("log")
    assert adapter.num_keys() == inner.num_keys()


def test_torchs_exit_barrier_runs_over_two_adapters() -> None:
    shared = HashStore(timeout=5)
    errors: list[BaseException] = []

    def member() -> None:
        try:
            store_util.barrier(as_torch_store(PrefixStore("round/0", shared)), 2, "exit", 10)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=member) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(t.is_alive() for t in threads)
    assert errors == []


def test_timeouts_follow_set_timeout_and_become_dist_store_errors() -> None:
    adapter = as_torch_store(HashStore(timeout=30))
    adapter.set_timeout(timedelta(seconds=0.2))
    assert adapter.timeout == timedelta(seconds=0.2)  # type: ignore[attr-defined]
    with pytest.raises(torch_dist.DistStoreError, match=r"timed out after 0\.2 s"):
        adapter.get("never")
    with pytest.raises(torch_dist.DistStoreError):
        adapter.wait(["never"])
    with pytest.raises(torch_dist.DistStoreError):
        adapter.wait(["never"], timedelta(seconds=0.1))


def test_a_lost_store_becomes_a_dist_network_error() -> None:
    server = TCPStoreServer("127.0.0.1", 0).start()
    client = TCPStore("127.0.0.1", server.port, timeout=2)
    try:
        adapter = as_torch_store(client)
        assert adapter.add("k", 1) == 1
        server.stop()
        with pytest.raises(torch_dist.DistNetworkError):
            adapter.add("k", 1)  # acknowledged, unlike set
    finally:
        client.close()
        server.stop()
