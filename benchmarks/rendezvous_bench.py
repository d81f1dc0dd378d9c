"""rdzv's DynamicRendezvousHandler side by side with torch's, on one machine.

Run:  python benchmarks/rendezvous_bench.py            (full table)
      python benchmarks/rendezvous_bench.py --quick    (smaller, faster)
      python benchmarks/rendezvous_bench.py --backends torch,etcd

Backends (columns), all by default:

* torch: torch's DynamicRendezvousHandler over its c10d backend and TCPStore;
* rdzv: rdzv's handler over its c10d backend and its own TCP store;
* etcd: rdzv's handler over its etcd v3 backend (``rdzv.create_handler``);
* redis: rdzv's handler over its Redis backend (``rdzv.create_handler``).

The TCP stores are hosted by this process; etcd and redis-server are private
servers started for the run on free loopback ports in temporary directories
(``tests/engines/servers.py``) and stopped by pid at the end, also on Ctrl-C.

Each scenario runs N agents spread over several worker processes (4, or
N/64 for large N: hundreds of threads in one process measure the GIL, not
the rendezvous), each agent a thread with its own store or engine
connection(s), all released at the same instant. Numbers are medians over
the repetitions; the ratio columns are torch's figure over each rdzv one.

* formation: min = max = N; time from the common start until the last agent
  returns from next_rendezvous; for the TCP-store backends also the backend
  writes, failed compare-and-sets and bytes written during it (counted by a
  wrapper around each agent's store; not counted on etcd and Redis).
* last-call overhead: 3 agents, min 2, max 4, last call 1 s; formation time
  minus the last call.
* recovery: 3 agents in 3 processes (min 2, max 3), heartbeat expiry 3 s
  (keep-alive 1 s x 3); one is SIGKILLed; the survivors re-rendezvous at once
  (as an agent does when its workers fail); time from the kill until both
  completed the new round.
* late joiner: 2 members poll num_nodes_waiting() every 2 ms; time from a
  third node's next_rendezvous() call until a member sees it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any

from _common import make_handler, release, stamp, subprocess_env

BACKENDS = ("torch", "rdzv", "etcd", "redis")
LABELS = {
    "torch": "torch 2.13 c10d",
    "rdzv": "rdzv c10d",
    "etcd": "rdzv etcd",
    "redis": "rdzv redis",
}
ENGINES = ("etcd", "redis")

# --------------------------------------------------------------------------
# Counting wrappers
# --------------------------------------------------------------------------


class Counts:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.writes = 0
        self.failed_cas = 0
        self.bytes_written = 0

    def add(self, writes: int = 0, failed: int = 0, nbytes: int = 0) -> None:
        with self.lock:
            self.writes += writes
            self.failed_cas += failed
            self.bytes_written += nbytes

    def as_dict(self) -> dict[str, int]:
        return {"writes": self.writes, "failed_cas": self.failed_cas, "bytes": self.bytes_written}

    def count(self, name: str, args: tuple[Any, ...], result: Any) -> None:
        """Count a store call that writes (a :class:`CountingStore`'s count).

        A compare-and-set whose expected and desired values are equal is
        rdzv's read probe, not a write; an ``add`` of 0 is a read.
        """
        if name in ("set", "append", "queue_push"):
            self.add(1, 0, len(_bytes(args[1])))
        elif name == "add" and args[1]:
            self.add(1, 0, 8)
        elif name == "compare_set" and args[1] != args[2]:
            desired = _bytes(args[2])
            self.add(1, 0 if bytes(result) == desired else 1, len(desired))
        elif name == "delete_key":
            self.add(1)
        elif name == "multi_set":
            self.add(1, 0, sum(len(_bytes(v)) for v in args[1]))


def _bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


# --------------------------------------------------------------------------
# Agents (inside worker processes)
# --------------------------------------------------------------------------


def worker(impl: str, cfg: dict[str, Any]) -> None:
    counts = Counts()
    handlers = [
        make_handler(impl, cfg, f"127.0.{cfg['proc']}.{i + 1}", counts.count)
        for i in range(cfg["threads"])
    ]
    print(json.dumps({"ready": True}), flush=True)
    line = sys.stdin.readline().split()
    start_at = float(line[1])
    results: list[dict[str, Any]] = [{} for _ in handlers]

    def run(index: int, handler: Any) -> None:
        time.sleep(max(0.0, start_at - time.time()))
        try:
            info = handler.next_rendezvous()
            results[index] = {"done": time.time(), "rank": info.rank, "world": info.world_size}
        except Exception as exc:
            results[index] = {"error": f"{type(exc).__name__}: {exc}"}

    threads = [
        threading.Thread(target=run, args=(i, h), daemon=True) for i, h in enumerate(handlers)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=cfg["join"] + 30)
    print(json.dumps({"results": results, "counts": counts.as_dict()}), flush=True)
    if cfg.get("rejoin"):
        # Recovery scenario: wait for the kill time, then re-rendezvous at once.
        line = sys.stdin.readline().split()
        try:
            info = handlers[0].next_rendezvous()
            print(json.dumps({"done": time.time(), "world": info.world_size}), flush=True)
        except Exception as exc:
            print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
    os._exit(0)


# --------------------------------------------------------------------------
# The driver
# --------------------------------------------------------------------------


class Host:
    """Where one run's agents meet: a store server hosted in this process, or an engine."""

    def __init__(self, impl: str, engines: dict[str, str]) -> None:
        self.store: Any = None
        self.port = 0
        self.endpoint = engines.get(impl, "")
        if impl == "rdzv":
            from rdzv.store.tcp import TCPStore

            self.store = TCPStore("127.0.0.1", 0, is_master=True, timeout=120)
        elif impl == "torch":
            import torch.distributed as dist

            self.store = dist.TCPStore(
                "127.0.0.1",
                0,
                is_master=True,
                timeout=timedelta(seconds=120),
                wait_for_workers=False,
            )
        elif not self.endpoint:
            raise ValueError(f"no server was started for backend {impl!r}")
        if self.store is not None:
            self.port = int(self.store.port)

    def config(self) -> dict[str, Any]:
        """What an agent needs to reach this host (two store connections; 60 s engine reads)."""
        return {
            "port": self.port,
            "endpoint": self.endpoint,
            "two_clients": True,
            "read_timeout": 60,
        }

    def close(self) -> None:
        if hasattr(self.store, "close"):
            self.store.close()
        self.store = None


_run_counter = 0


def spawn_agents(
    impl: str, engines: dict[str, str], n: int, procs: int, **cfg: Any
) -> tuple[list[subprocess.Popen[str]], Host]:
    global _run_counter
    _run_counter += 1
    host = Host(impl, engines)
    workers: list[subprocess.Popen[str]] = []
    per = [n // procs + (1 if i < n % procs else 0) for i in range(procs)]
    try:
        for index, threads in enumerate(t for t in per if t):
            config = {
                **host.config(),
                "run_id": f"bench{_run_counter}",
                "threads": threads,
                "proc": index,
                **cfg,
            }
            workers.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--worker", impl, json.dumps(config)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    env=subprocess_env(),
                )
            )
        wait_ready(impl, workers)
    except BaseException:
        finish(workers, host)
        raise
    return workers, host


def wait_ready(impl: str, workers: list[subprocess.Popen[str]]) -> None:
    """Wait until every worker built its handlers (each prints one line)."""
    for w in workers:
        assert w.stdout is not None
        if not w.stdout.readline():
            raise RuntimeError(f"a {impl} worker died while starting")


def collect(workers: list[subprocess.Popen[str]]) -> tuple[list[dict[str, Any]], dict[str, int]]:
    results: list[dict[str, Any]] = []
    totals = {"writes": 0, "failed_cas": 0, "bytes": 0}
    for w in workers:
        assert w.stdout is not None
        report = json.loads(w.stdout.readline())
        results.extend(report["results"])
        for key in totals:
            totals[key] += report["counts"][key]
    return results, totals


def finish(workers: list[subprocess.Popen[str]], host: Host) -> None:
    for w in workers:
        if w.poll() is None:
            w.kill()
        w.wait(timeout=30)
        for stream in (w.stdin, w.stdout):
            if stream is not None:
                stream.close()
    host.close()


def formation(
    impl: str,
    engines: dict[str, str],
    n: int,
    procs: int,
    last_call: float = 30.0,
    min_nodes: int | None = None,
    max_nodes: int | None = None,
    join: float = 120.0,
) -> dict[str, Any]:
    workers, host = spawn_agents(
        impl,
        engines,
        n,
        procs,
        min=min_nodes or n,
        max=max_nodes or n,
        join=join,
        last_call=last_call,
        interval=5.0,
        attempts=3,
    )
    try:
        start_at = release(workers, 0.3)
        results, counts = collect(workers)
    finally:
        finish(workers, host)
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        return {"error": errors[0]}
    ranks = sorted(r["rank"] for r in results)
    assert ranks == list(range(len(results))), f"{impl}: inconsistent ranks {ranks}"
    return {"time": max(r["done"] for r in results) - start_at, **counts}


def recovery(impl: str, engines: dict[str, str]) -> dict[str, Any]:
    workers, host = spawn_agents(
        impl,
        engines,
        3,
        3,
        min=2,
        max=3,
        join=60.0,
        last_call=0.1,
        interval=1.0,
        attempts=3,
        rejoin=True,
    )
    try:
        release(workers, 0.3)
        collect(workers)
        time.sleep(0.5)
        victim, survivors = workers[1], [workers[0], workers[2]]
        killed_at = time.time()
        os.kill(victim.pid, signal.SIGKILL)
        for w in survivors:
            assert w.stdin is not None
            w.stdin.write("rejoin\n")
            w.stdin.flush()
        done = []
        for w in survivors:
            assert w.stdout is not None
            report = json.loads(w.stdout.readline())
            if "error" in report:
                return {"error": report["error"]}
            done.append(report["done"])
        return {"time": max(done) - killed_at}
    finally:
        finish(workers, host)


def late_joiner(impl: str, engines: dict[str, str]) -> dict[str, Any]:
    host = Host(impl, engines)
    cfg = {
        **host.config(),
        "run_id": f"late{time.time_ns()}",
        "min": 2,
        "max": 4,
        "join": 60.0,
        "last_call": 0.2,
        "interval": 5.0,
        "attempts": 3,
    }
    counts = Counts()
    try:
        members = [make_handler(impl, cfg, f"127.0.0.{i}", counts.count) for i in (1, 2)]
        threads = [threading.Thread(target=h.next_rendezvous, daemon=True) for h in members]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        time.sleep(1.5)  # let any cached view go stale before the late arrival
        late = make_handler(impl, cfg, "127.0.0.9", counts.count)
        seen = threading.Event()
        started_at: list[float] = []
        seen_at: list[float] = []

        def poll() -> None:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                if started_at and members[0].num_nodes_waiting() > 0:
                    seen_at.append(time.perf_counter())
                    seen.set()
                    return
                time.sleep(0.002)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        time.sleep(0.05)
        started_at.append(time.perf_counter())

        def join_late() -> None:
            # Ends with a connection error when the host closes after the
            # measurement; only the visibility matters here.
            try:
                late.next_rendezvous()
            except Exception:
                return

        threading.Thread(target=join_late, daemon=True).start()
        poller.join(timeout=30)
        if not seen_at:
            return {"error": "never seen"}
        return {"time": seen_at[0] - started_at[0]}
    finally:
        host.close()


def median(values: list[dict[str, Any]], key: str) -> float | None:
    good = [v[key] for v in values if "error" not in v]
    return statistics.median(good) if good else None


def fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "failed"
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def parse_backends(text: str) -> list[str]:
    """The comma-separated backend names of ``--backends``, validated, in table order."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in BACKENDS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown backend(s) {unknown or text!r}; choose from {', '.join(BACKENDS)}"
        )
    return [name for name in BACKENDS if name in names]


class Table:
    """Rows of per-backend figures, with torch's figure over each rdzv one."""

    def __init__(self, backends: list[str]) -> None:
        self.backends = backends
        self.ratio_of = [b for b in backends if b != "torch"] if "torch" in backends else []
        self.rows: list[list[str]] = []

    def row(self, name: str, values: dict[str, float | None], unit: str = "time") -> None:
        cells = [name]
        for impl in self.backends:
            value = values.get(impl)
            if unit == "time":
                cells.append(fmt_time(value) if impl in values else "-")
            else:
                cells.append("-" if value is None else f"{value:,.0f}")
        torch_v = values.get("torch")
        for impl in self.ratio_of:
            value = values.get(impl)
            cells.append(f"{torch_v / value:.1f}x" if torch_v and value else "-")
        self.rows.append(cells)
        print("  " + " | ".join(cells), file=sys.stderr, flush=True)

    def markdown(self) -> str:
        head = ["scenario", *(LABELS[b] for b in self.backends)]
        head += [f"torch / {LABELS[b]}" for b in self.ratio_of]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(cells) + " |" for cells in self.rows]
        return "\n".join(lines)


def run_all(args: argparse.Namespace, backends: list[str], engines: dict[str, str]) -> Table:
    """Run every scenario on every selected backend; return the table."""
    sizes = [int(s) for s in args.sizes.split(",") if s]
    big = [int(s) for s in args.rdzv_only_sizes.split(",") if s] if "rdzv" in backends else []
    counted = [b for b in backends if b not in ENGINES]
    table = Table(backends)

    def repeat(scenario: Any, *extra: Any, **kwargs: Any) -> dict[str, list[dict[str, Any]]]:
        return {
            impl: [scenario(impl, engines, *extra, **kwargs) for _ in range(args.repeat)]
            for impl in backends
        }

    for n in sizes:
        procs = max(args.procs, n // 64)
        results = repeat(formation, n, procs)
        table.row(f"formation N={n}", {b: median(results[b], "time") for b in backends})
        for key, label in (
            ("writes", "writes"),
            ("failed_cas", "failed CAS"),
            ("bytes", "bytes written"),
        ):
            table.row(
                f"  N={n} {label}",
                {b: median(results[b], key) for b in counted},
                unit="count",
            )
    for n in big:
        procs = max(args.procs, n // 64)
        results = {"rdzv": [formation("rdzv", engines, n, procs) for _ in range(args.repeat)]}
        table.row(f"formation N={n} (rdzv c10d only)", {"rdzv": median(results["rdzv"], "time")})
        for key, label in (("writes", "writes"), ("bytes", "bytes written")):
            table.row(
                f"  N={n} {label}",
                {"rdzv": median(results["rdzv"], key)},
                unit="count",
            )
    last_call = repeat(formation, 3, 3, last_call=1.0, min_nodes=2, max_nodes=4)
    table.row(
        "last-call overhead (beyond 1 s)",
        {
            b: median([{"time": r["time"] - 1.0} if "time" in r else r for r in v], "time")
            for b, v in last_call.items()
        },
    )
    rec = repeat(recovery)
    table.row("recovery after SIGKILL (3 s expiry)", {b: median(rec[b], "time") for b in backends})
    late = repeat(late_joiner)
    table.row("late joiner seen by members", {b: median(late[b], "time") for b in backends})
    return table


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument(
        "--backends",
        type=parse_backends,
        default=list(BACKENDS),
        help=f"comma-separated columns to run (default: {','.join(BACKENDS)})",
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--procs",
        type=int,
        default=4,
        help="worker processes (at least; N/64 for large N, so no process runs over 64 agents)",
    )
    parser.add_argument("--sizes", default="8,32,128")
    parser.add_argument("--rdzv-only-sizes", default="1024")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], json.loads(args.worker[1]))
        return
    if args.quick:
        args.repeat, args.sizes, args.rdzv_only_sizes = 1, "8,32", ""
    stamp("start")
    from tests.engines.servers import engine_servers

    with engine_servers(args.backends) as engines:
        table = run_all(args, args.backends, engines)
    stamp("end")
    print(
        f"\nmedian of {args.repeat}; max({args.procs}, N/64) worker processes; "
        f"{os.cpu_count()} CPUs\n"
    )
    print(table.markdown())


if __name__ == "__main__":
    main()
