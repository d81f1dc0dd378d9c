"""Rendezvous on etcd and Redis, side by side with torch's c10d backend.

Formation: N handlers (threads of one process, min = max = N) call
``next_rendezvous()`` at once; the time until the last one returns.
Recovery: 4 agent processes form a round (keep-alive 0.2 s x 3), one is
SIGKILLed; the time until every survivor completed the next round (the
survivors poll ``num_nodes_waiting()``, which turns positive once the dead
member is evicted). torch's handler reports only joining nodes there, so it
has no recovery column (benchmarks/rendezvous_bench.py measures torch's
recovery with re-rendezvous on failure). Servers are private (free loopback
ports). Run from the repository root:

    PYTHONPATH=src:. python benchmarks/engines_rendezvous_bench.py [--sizes 8,128]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from tests.engines.servers import etcd_cluster, kill_process, redis_server, stop_process
from tests.procs import subprocess_env

import rdzv


def form(make: Callable[[int], Any], size: int, timeout: float = 300) -> float:
    """Return seconds until ``size`` handlers built by ``make(i)`` all completed a round."""
    handlers = [make(i) for i in range(size)]
    barrier = threading.Barrier(size + 1)
    done: list[float] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def join(handler: Any) -> None:
        try:
            barrier.wait(timeout=60)
            handler.next_rendezvous()
            with lock:
                done.append(time.perf_counter())
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(h,), daemon=True) for h in handlers]
    for t in threads:
        t.start()
    barrier.wait(timeout=60)
    start = time.perf_counter()
    for t in threads:
        t.join(timeout=timeout)
    for handler in handlers:
        handler.shutdown()
    if errors or len(done) != size:
        raise RuntimeError(f"formation of {size} failed: {errors[:1]!r}")
    return max(done) - start


def rdzv_maker(backend: str, endpoint: str, size: int) -> Callable[[int], Any]:
    run = f"bench{uuid.uuid4().hex[:8]}"

    def make(_: int) -> Any:
        params = rdzv.RendezvousParameters(
            backend,
            endpoint,
            run,
            size,
            size,
            local_addr="127.0.0.1",
            join_timeout=300,
            last_call_timeout=1,
            read_timeout=60,
        )
        return rdzv.create_handler(params)

    return make


def torch_maker(port: int, size: int) -> Callable[[int], Any]:
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        RendezvousTimeout,
    )

    run = f"bench{uuid.uuid4().hex[:8]}"

    def make(_: int) -> Any:
        store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))
        backend = C10dRendezvousBackend(store, run)
        return DynamicRendezvousHandler.from_backend(
            run,
            store,
            backend,
            size,
            size,
            "127.0.0.1",
            RendezvousTimeout(join=timedelta(seconds=300), last_call=timedelta(seconds=1)),
        )

    return make


def recovery(backend: str, endpoint: str) -> float:
    """Seconds from SIGKILL of one of 4 agents until every survivor completed the next round."""
    run = f"rec{uuid.uuid4().hex[:8]}"
    args = [sys.executable, "-m", "tests.engines.rdzv_worker", backend, endpoint, run, "2", "4"]
    procs = [
        subprocess.Popen(
            [*args, "2"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=subprocess_env(),
        )
        for _ in range(4)
    ]
    try:
        for p in procs:
            assert p.stdout is not None
            json.loads(p.stdout.readline())
        killed = time.perf_counter()
        kill_process(procs[0])
        for p in procs[1:]:
            assert p.stdout is not None
            line = json.loads(p.stdout.readline())
            assert line["world_size"] == 3, line
        return time.perf_counter() - killed
    finally:
        for p in procs:
            stop_process(p)
            if p.stdout is not None:
                p.stdout.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--sizes", default="8,128")
    parser.add_argument("--no-torch", action="store_true")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    rows: dict[str, dict[str, str]] = {}
    with etcd_cluster(1) as cluster, redis_server() as server:
        for size in sizes:
            row = rows.setdefault(f"formation N={size} (s)", {})
            row["rdzv etcd"] = f"{form(rdzv_maker('etcd', cluster.endpoints, size), size):.2f}"
            row["rdzv redis"] = f"{form(rdzv_maker('redis', server.endpoint, size), size):.2f}"
            if not args.no_torch:
                from torch.distributed import TCPStore

                master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
                row["torch c10d"] = f"{form(torch_maker(master.port, size), size):.2f}"
                del master
        row = rows.setdefault("recovery after SIGKILL, 4 agents (s)", {})
        row["rdzv etcd"] = f"{recovery('etcd', cluster.endpoints):.2f}"
        row["rdzv redis"] = f"{recovery('redis', server.endpoint):.2f}"
        row["torch c10d"] = "-"
    columns = ["rdzv etcd", "rdzv redis", "torch c10d"]
    print("| | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(row.get(c, "-") for c in columns) + " |")


if __name__ == "__main__":
    main()
