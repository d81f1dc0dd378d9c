"""Latency of the etcd and Redis backends' primitives on loopback.

Starts a private etcd and a private Redis (free loopback ports, like the
tests), then measures medians and 95th percentiles of: a state read, a
compare-and-set write, a CAS that loses (returns the current value), the time
from a write to a watcher waking (wait_for_state), a store set and get, and
a heartbeat. Run from the repository root:

    PYTHONPATH=src:. python benchmarks/engines_bench.py [--rounds 300]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from tests.engines.servers import etcd_cluster, redis_server

from _common import stamp
from rdzv.backends.etcd import EtcdRendezvousBackend, parse_endpoints
from rdzv.backends.etcd.gateway import EtcdClient
from rdzv.backends.etcd.store import EtcdStore
from rdzv.backends.redis import RedisRendezvousBackend
from rdzv.backends.redis.store import RedisStore


def timed(action: Callable[[], Any], rounds: int) -> list[float]:
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        action()
        samples.append(time.perf_counter() - start)
    return samples


def notify_latency(backend: Any, rounds: int) -> list[float]:
    """Time from the start of a write to the waiting reader's return."""
    samples = []
    for i in range(rounds):
        current = backend.get_state()
        token = current[1] if current else None
        woke: list[float] = []

        def wait(token: Any = token, woke: list[float] = woke) -> None:
            backend.wait_for_state(token, 10.0)
            woke.append(time.perf_counter())

        thread = threading.Thread(target=wait)
        thread.start()
        time.sleep(0.005)  # let the waiter block
        start = time.perf_counter()
        writer = backend.set_state(f"n{i}".encode(), token)
        assert writer is not None
        thread.join(timeout=15)
        samples.append(woke[0] - start)
    return samples


def measure(backend: Any, store: Any, rounds: int) -> dict[str, list[float]]:
    backend.set_state(b"x" * 512)
    results: dict[str, list[float]] = {}
    results["get_state"] = timed(backend.get_state, rounds)

    state = backend.get_state()
    assert state is not None

    def cas_win() -> None:
        nonlocal state
        assert state is not None
        result = backend.set_state(b"z" * 512, state[1])
        assert result is not None
        assert result[2]
        state = (result[0], result[1])

    results["set_state (CAS wins)"] = timed(cas_win, rounds)
    results["set_state (CAS loses)"] = timed(lambda: backend.set_state(b"w", 1), rounds)
    results["write -> watcher wakes"] = notify_latency(backend, max(20, rounds // 5))
    results["store set"] = timed(lambda: store.set("k", b"v" * 64), rounds)
    results["store get"] = timed(lambda: store.get("k"), rounds)
    results["heartbeat (beat)"] = timed(lambda: backend.beat("node-1"), rounds)
    return results


def report(columns: dict[str, dict[str, list[float]]]) -> None:
    names = list(next(iter(columns.values())))
    header = "| operation | " + " | ".join(f"{c} median / p95 (ms)" for c in columns) + " |"
    print(header)
    print("|---" * (len(columns) + 1) + "|")
    for op in names:
        cells = []
        for col in columns.values():
            samples = sorted(col[op])
            p95 = samples[int(len(samples) * 0.95) - 1]
            cells.append(f"{statistics.median(samples) * 1e3:.2f} / {p95 * 1e3:.2f}")
        print(f"| {op} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    columns: dict[str, dict[str, list[float]]] = {}
    stamp("start")
    with etcd_cluster(1) as cluster:
        client = EtcdClient(parse_endpoints(cluster.endpoints), read_timeout=10)
        try:
            backend = EtcdRendezvousBackend(client, "bench")
            store = EtcdStore(client, b"/bench/store/")
            columns["etcd 3.4"] = measure(backend, store, args.rounds)
        finally:
            client.close()
    with redis_server() as server:
        rclient = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=20)
        try:
            rbackend = RedisRendezvousBackend(rclient, "bench")
            rstore = RedisStore(rclient, "bench:store:")
            columns["Redis 7"] = measure(rbackend, rstore, args.rounds)
        finally:
            rclient.close()
    stamp("end")
    report(columns)


if __name__ == "__main__":
    main()
