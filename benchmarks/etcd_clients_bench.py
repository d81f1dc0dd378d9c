"""The two etcd clients side by side: operations a second and CPU an operation.

Run:  python benchmarks/etcd_clients_bench.py --ops 4000

One private etcd member (``tests/engines/servers.py``, fast timers, on a free
loopback port). For each client (the JSON gateway's and gRPC's) and each
operation, a compare-and-put that wins (the key's current revision compared,
as a state write) and a range of one key (a state read), the benchmark runs
``--ops`` operations from one client in one thread, then from 128 clients
in 128 threads of this process (``--ops`` in all). It reports operations a
second, and CPU microseconds an operation of this process (every thread:
grpcio's own ones too) and of the etcd member (``/proc/<pid>/stat``).
"""

from __future__ import annotations

import argparse
import threading
import time
import uuid
from collections.abc import Callable

from tests.engines.servers import etcd_cluster

from _common import cpu_seconds, stamp
from rdzv.backends.etcd import parse_endpoints
from rdzv.backends.etcd.client import EtcdClientBase
from rdzv.backends.etcd.gateway import EtcdClient
from rdzv.backends.etcd.grpc import EtcdGrpcClient

CLIENTS: dict[str, type[EtcdClientBase]] = {"gateway": EtcdClient, "grpc": EtcdGrpcClient}


def _cas_loop(client: EtcdClientBase, count: int) -> None:
    key = f"/bench/{uuid.uuid4().hex}".encode()
    revision = 0
    for _ in range(count):
        written, revision, _, _ = client.compare_and_put(key, b"x" * 64, revision)
        assert written


def _range_loop(client: EtcdClientBase, count: int) -> None:
    key = f"/bench/{uuid.uuid4().hex}".encode()
    client.put(key, b"x" * 64)
    for _ in range(count):
        client.range(key)


def measure(
    endpoints: list[tuple[str, int]],
    kind: type[EtcdClientBase],
    loop: Callable[[EtcdClientBase, int], None],
    clients: int,
    ops: int,
    etcd_pid: int,
) -> tuple[float, float, float]:
    """Return ``(ops a second, client CPU µs an op, etcd CPU µs an op)``."""
    made = [kind(endpoints, read_timeout=30) for _ in range(clients)]
    try:
        for client in made:  # connect first: a connection is not an operation
            client.count(b"/warm/")
        per_client = ops // clients
        threads = [threading.Thread(target=loop, args=(c, per_client)) for c in made]
        own, etcd, start = time.process_time(), cpu_seconds(etcd_pid), time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.monotonic() - start
        own, etcd = time.process_time() - own, cpu_seconds(etcd_pid) - etcd
    finally:
        for client in made:
            client.close()
    done = per_client * clients
    return done / wall, own / done * 1e6, etcd / done * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--ops", type=int, default=4000, help="operations per measurement")
    args = parser.parse_args()
    loops = {"compare-and-put": _cas_loop, "range": _range_loop}
    rows = []
    stamp("start")
    with etcd_cluster(1) as cluster:
        proc = cluster.members[0].proc
        assert proc is not None
        endpoints = parse_endpoints(cluster.endpoints)
        for clients in (1, 128):
            for op, loop in loops.items():
                for name, kind in CLIENTS.items():
                    rate, own, etcd = measure(endpoints, kind, loop, clients, args.ops, proc.pid)
                    rows.append((name, clients, op, rate, own, etcd))
    stamp("end")
    print("| client | clients | operation | ops/s | client CPU µs/op | etcd CPU µs/op |")
    print("|---|---|---|---|---|---|")
    for name, clients, op, rate, own, etcd in rows:
        print(f"| {name} | {clients} | {op} | {rate:,.0f} | {own:,.0f} | {etcd:,.0f} |")


if __name__ == "__main__":
    main()
