"""The workers' bootstrap store under N ranks' ``init_process_group``, beside torch's server.

Run from the repository root:

    python benchmarks/bootstrap_bench.py [--sizes 1024 4096 16384] [--servers rdzv torch]
                                         [--procs 6] [--timeout 600]

Each cell is one server in a fresh host process, standing in for group rank
0's agent, and N ranks, each one of torch's own C++ ``TCPStore`` clients on a
thread of its own, spread over ``--procs`` client processes. The servers:

* ``rdzv``: the bootstrap store as ``rdzv run`` starts it
  (``rdzv.launch.bootstrap.bootstrap_server`` for a round of N workers on N / 8
  agents; from 1,024 workers on, with torch importable, torch's libuv server on
  a socket rdzv binds);
* ``torch``: ``torch.distributed.TCPStore(is_master=True, use_libuv=True)``,
  as torchrun's agent starts it;
* ``rdzv-server``: rdzv's own server as the factory starts it without torch
  (the fallback; its connection limit derived from N).

Every rank, released at the same instant, does what ``init_process_group``
does with the store: connect, ``set`` its address, ``add`` 1 to a counter
(the rank whose ``add`` reaches N sets ``all_in``), rank 0 waits for
``all_in`` and sets ``go``, every rank ``get("go")`` (the init); then rank 0
publishes a 128-character unique id, every rank reads it, and all pass torch's
store-based barrier (``_store_based_barrier``; the NCCL pattern). The table
shows the time from the release to the last rank's ``go`` (init) and to the
last rank out of the barrier (total), each as a ratio of torch's server: the
best of ``--repeat`` interleaved runs (each the servers in turn, the first
of one run the last of the next), which
filters out other load on the machine; the other columns are that run's,
and the last lists every run's total.

Beside the server, the host process runs an agent's rendezvous as ``rdzv
run``'s group rank 0 would: rdzv's rendezvous store hosted in the same
process and two ``DynamicRendezvousHandler`` members of one round over it,
their keep-alive beating every ``--interval`` s. The table shows the longest
gap between two beats of either member while the ranks ran (the beat is
late when it exceeds the interval), and the dead-node judgements and failed
beats (both must be 0). ``RSS/conn`` is the host process's resident memory
with every rank connected, less its memory before the release, divided by N.
The host's CPU seconds and the machine's load (before and after) come with
each row.

torch's C++ client looks up the names of both ends of every connection it
makes (``getnameinfo``, for its log lines). Where the DNS server answers
slowly or drops concurrent queries (on the machine this was written on,
thousands of simultaneous look-ups of ``::ffff:127.0.0.1`` each waited out
the resolver's 5 s timeout, whatever the server), that cost swamps the
store's. So every process of the benchmark runs in a mount namespace of its
own (``unshare -m``, root) that sees an ``/etc/resolv.conf`` naming a
nameserver on 127.0.0.1, where nothing listens: a look-up fails at once, as
on a host with a local resolver, and the names come out numeric.
``--real-resolver`` keeps the machine's resolver.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from _common import cpu_seconds, load, release, rss_bytes, stamp, subprocess_env

SERVERS = ("rdzv", "torch", "rdzv-server")
RANKS_PER_HOST = 8
UNIQUE_ID = "u" * 128
THREAD_STACK = 256 * 1024
SWITCH_INTERVAL = 1.0


# ---------------------------------------------------------------- host process


def start_server(kind: str, n: int) -> Any:
    """Start the server of ``kind`` for ``n`` ranks; return an object that keeps it alive."""
    from rdzv.launch.bootstrap import (
        BootstrapSpec,
        bootstrap_server,
        raise_open_files,
        rdzv_store_server,
    )

    spec = BootstrapSpec(n, max(1, n // RANKS_PER_HOST))  # every address, as rdzv run's
    if kind == "rdzv":
        return bootstrap_server(spec)
    if kind == "rdzv-server":
        return rdzv_store_server(spec)
    from torch._C._distributed_c10d import TCPStore

    raise_open_files(2 * n)  # the same room as rdzv's, so the limit is not what differs
    return TCPStore(
        "127.0.0.1", 0, None, True, timedelta(seconds=600), wait_for_workers=False, use_libuv=True
    )


class Rendezvous:
    """Two members of one round over a store hosted here, their beats timed."""

    def __init__(self, interval: float) -> None:
        from rdzv.api import RendezvousTimeout
        from rdzv.backends.store import C10dRendezvousBackend
        from rdzv.dynamic.handler import DynamicRendezvousHandler
        from rdzv.launch.progress import EventListener
        from rdzv.store.tcp import TCPStore

        self.beats: dict[str, list[float]] = {}
        self.events: dict[str, int] = {"dead": 0, "evict": 0, "keepalive-failed": 0}
        self._server = TCPStore("127.0.0.1", 0, is_master=True)
        beats = self.beats

        class TimedBackend(C10dRendezvousBackend):
            def beat(self, node: str) -> None:
                beats.setdefault(node, []).append(time.monotonic())
                super().beat(node)

        run_id = "bootstrap-bench"
        self.handlers = []
        for name in ("agent-a", "agent-b"):
            store = TCPStore("127.0.0.1", self._server.port, timeout=120)
            self.handlers.append(
                DynamicRendezvousHandler.from_backend(
                    run_id,
                    store,
                    TimedBackend(store, run_id),
                    2,
                    2,
                    local_addr=name,
                    timeout=RendezvousTimeout(join=120, last_call=0.5),
                    keep_alive_interval=interval,
                    keep_alive_max_attempt=3,
                )
            )
        self._listener = EventListener(self._event, run_id, None)
        self._listening = self._listener.attached()
        self._listening.__enter__()
        threads = [threading.Thread(target=h.next_rendezvous) for h in self.handlers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)

    def _event(self, event: Any) -> None:
        action = event.get("action")
        if action in self.events:
            self.events[action] += 1

    def longest_gap(self, since: float, until: float) -> float:
        """The longest wait of one member for its next beat between ``since`` and ``until``.

        A beat still awaited at ``until`` counts from the member's last beat.
        """
        gaps = []
        for times in self.beats.values():
            last = since
            for t in times:
                if t > since:
                    gaps.append(t - last)
                last = t
            gaps.append(until - last)
        return max(gaps, default=float("nan"))


def host(kind: str, n: int, interval: float) -> None:
    """Serve one cell: the server and the agent's rendezvous, driven by lines on stdin."""
    rendezvous = Rendezvous(interval)
    server = start_server(kind, n)
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    print(f"ready {server.port} {rss_bytes()} {soft}", flush=True)
    started = time.monotonic()
    for line in sys.stdin:
        if line.startswith("go"):
            started = time.monotonic()
        elif line.startswith("rss"):
            print(f"rss {rss_bytes()}", flush=True)
        elif line.startswith("end"):
            report = {
                "gap": rendezvous.longest_gap(started, time.monotonic()),
                "events": rendezvous.events,
            }
            print("report " + json.dumps(report), flush=True)
            break
    del server
    os._exit(0)  # the handlers' keep-alive threads are not worth a clean shutdown here


# -------------------------------------------------------------- client process


def clients(port: int, n: int, first: int, count: int, timeout: float) -> None:
    """Run ranks ``first`` to ``first + count - 1`` of ``n`` on threads; report their times."""
    from torch._C._distributed_c10d import TCPStore
    from torch.distributed.distributed_c10d import _store_based_barrier

    wait = timedelta(seconds=timeout)
    go = threading.Event()
    done: list[tuple[float, float, float]] = []
    errors: list[str] = []
    stores: list[Any] = []
    lock = threading.Lock()

    def rank_main(rank: int) -> None:
        go.wait()
        try:
            store = TCPStore("127.0.0.1", port, None, False, wait, wait_for_workers=False)
            connected = time.time()
            store.set(f"addr/{rank}", f"10.0.{rank // 256}.{rank % 256}:29500")
            if store.add("count", 1) == n:
                store.set("all_in", "1")
            if rank == 0:
                store.get("all_in")
                store.set("go", "1")
            store.get("go")
            init = time.time()
            if rank == 0:
                store.set("nccl_id", UNIQUE_ID)
            store.get("nccl_id")
            _store_based_barrier(rank, store, "bench", n, wait)  # type: ignore[arg-type]
            with lock:
                done.append((connected, init, time.time()))
                stores.append(store)
        except Exception as exc:
            with lock:
                errors.append(f"rank {rank}: {type(exc).__name__}: {str(exc).splitlines()[0]}")

    # Thousands of threads coming back from torch's calls at once queue for
    # the interpreter lock; each waiter wakes every switch interval to ask
    # for it, which at the default 5 ms swamps the lock's own mutex. The
    # threads give the lock up at every store call anyway.
    sys.setswitchinterval(SWITCH_INTERVAL)
    threading.stack_size(THREAD_STACK)
    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(first, first + count)]
    for t in threads:
        t.start()
    print("ready", flush=True)
    line = sys.stdin.readline().split()
    start_at = float(line[1])
    time.sleep(max(0.0, start_at - time.time()))
    go.set()
    for t in threads:
        t.join()
    times = {
        "connect": max((d[0] for d in done), default=0.0),
        "init": max((d[1] for d in done), default=0.0),
        "total": max((d[2] for d in done), default=0.0),
        "errors": len(errors),
        "first_error": errors[0] if errors else "",
    }
    print("done " + json.dumps(times), flush=True)
    sys.stdin.readline()  # "exit": the ranks stay connected until the host's RSS is read
    os._exit(0)


# ---------------------------------------------------------------------- driver


def read_line(proc: subprocess.Popen[str], prefix: str, deadline: float) -> str:
    """Return the next stdout line of ``proc`` that starts with ``prefix`` (bounded by deadline)."""
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"process {proc.pid} ended before {prefix!r}")
        if line.startswith(prefix):
            return line[len(prefix) :].strip()
    raise TimeoutError(f"no {prefix!r} line from process {proc.pid}")


def spawn(args: Sequence[str], resolver: str | None) -> subprocess.Popen[str]:
    """Start this script with ``args``; with ``resolver``, in a mount namespace that sees it as
    ``/etc/resolv.conf``."""
    command = [sys.executable, __file__, *args]
    if resolver is not None:
        mount = 'mount --bind "$0" /etc/resolv.conf && exec "$@"'
        command = ["unshare", "-m", "sh", "-c", mount, resolver, *command]
    return subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=subprocess_env(),
    )


def send(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def run_cell(kind: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    """Measure one server at one size; every process started here is stopped here."""
    deadline = time.monotonic() + args.timeout + 120
    procs: list[subprocess.Popen[str]] = []
    try:
        server = spawn(["--host", kind, str(n), str(args.interval)], args.resolver)
        procs.append(server)
        port, rss_before, soft = (int(x) for x in read_line(server, "ready ", deadline).split())
        per = -(-n // args.procs)
        group = []
        for first in range(0, n, per):
            count = min(per, n - first)
            argv = ["--clients", str(port), str(n), str(first), str(count), str(args.timeout)]
            group.append(spawn(argv, args.resolver))
        procs.extend(group)
        for proc in group:
            read_line(proc, "ready", deadline)
        cpu_before = cpu_seconds(server.pid)
        load_before = load()
        send(server, "go")
        start_at = release(group, 1.0)
        results = [json.loads(read_line(proc, "done ", deadline)) for proc in group]
        send(server, "rss")
        rss_after = int(read_line(server, "rss ", deadline))
        send(server, "end")
        report = json.loads(read_line(server, "report ", deadline))
        cpu = cpu_seconds(server.pid) - cpu_before
        for proc in group:
            send(proc, "exit")
        return {
            "server": kind,
            "n": n,
            "init": max(r["init"] for r in results) - start_at,
            "total": max(r["total"] for r in results) - start_at,
            "errors": sum(r["errors"] for r in results),
            "first_error": next((r["first_error"] for r in results if r["first_error"]), ""),
            "rss_per_conn": (rss_after - rss_before) / n,
            "rss_mb": rss_after / 2**20,
            "cpu": cpu,
            "gap": report["gap"],
            "events": report["events"],
            "nofile": soft,
            "load_before": load_before,
            "load_after": load(),
        }
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=["rdzv", "torch"])
    parser.add_argument("--repeat", type=int, default=1, help="interleaved runs; the best shows")
    parser.add_argument("--procs", type=int, default=6, help="client processes")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds, per store call")
    parser.add_argument("--interval", type=float, default=1.0, help="keep-alive interval (s)")
    parser.add_argument(
        "--real-resolver",
        action="store_true",
        help="keep the machine's /etc/resolv.conf (see the module's docstring)",
    )
    args = parser.parse_args()
    args.resolver = None
    if not args.real_resolver:
        handle, args.resolver = tempfile.mkstemp(prefix="bootstrap-bench-", suffix=".conf")
        os.write(handle, b"nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        os.close(handle)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    print(f"open-file limit (RLIMIT_NOFILE): soft {soft}, hard {hard}")
    stamp("start")
    rows: list[dict[str, Any]] = []
    for n in args.sizes:
        best: dict[str, dict[str, Any]] = {}
        runs: dict[str, list[float]] = {kind: [] for kind in args.servers}
        for turn in range(args.repeat):
            for kind in (
                args.servers[turn % len(args.servers) :] + args.servers[: turn % len(args.servers)]
            ):
                row = run_cell(kind, n, args)
                print(json.dumps(row), file=sys.stderr, flush=True)
                runs[kind].append(row["total"])
                if kind not in best or (row["errors"], row["total"]) < (
                    best[kind]["errors"],
                    best[kind]["total"],
                ):
                    best[kind] = row
        for kind in args.servers:
            best[kind]["runs"] = runs[kind]
            rows.append(best[kind])
    stamp("end")
    if args.resolver is not None:
        os.unlink(args.resolver)
    torch_rows = {r["n"]: r for r in rows if r["server"] == "torch"}
    print(
        "\n| ranks | server | init (s) | total (s) | x torch (init / total) | errors "
        "| longest beat gap (s) | judged dead / failed beats | RSS/conn (KB) | host CPU (s) "
        "| load before -> after | total of every run (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ref = torch_rows.get(r["n"])
        ratio = (
            f"{r['init'] / ref['init']:.2f} / {r['total'] / ref['total']:.2f}"
            if ref and r["errors"] == 0 and ref["errors"] == 0
            else "n/a"
        )
        ev = r["events"]
        print(
            f"| {r['n']:,} | {r['server']} | {r['init']:.2f} | {r['total']:.2f} | {ratio} "
            f"| {r['errors']} | {r['gap']:.2f} | {ev['dead'] + ev['evict']} / "
            f"{ev['keepalive-failed']} | {r['rss_per_conn'] / 1024:.1f} | {r['cpu']:.1f} "
            f"| {r['load_before'].split(' on')[0]} -> {r['load_after'].split(' on')[0]} "
            f"| {', '.join(f'{t:.2f}' for t in r['runs'])} |"
        )
    for r in rows:
        if r["first_error"]:
            print(f"{r['server']} at {r['n']}: {r['errors']} errors, e.g. {r['first_error']}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--host":
        host(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--clients":
        port, n, first, count = (int(x) for x in sys.argv[2:6])
        clients(port, n, first, count, float(sys.argv[6]))
    else:
        main()
