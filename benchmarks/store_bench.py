"""Throughput of rdzv's TCP store next to torch's C++ TCPStore, side by side.

Run from the repository root:

    python benchmarks/store_bench.py [--duration 2] [--clients 1 8] [--loops asyncio uvloop]
                                     [--before GIT_REF]

Every server runs in its own process (torch's ``TCPStore(is_master=True)``,
and ``rdzv serve --loop LOOP`` once per event loop of ``--loops``), every
client in its own process. Each client repeats one operation on its own key
with a 100-byte value for ``--duration`` seconds, all clients starting at the
same instant; the table shows the sum of their operations per second (a
client's sets count until the server has taken the last one, which a ``get``
after them shows: sets have no reply, and those still in the socket buffers
when the time is up are not done yet; the
best of ``--repeat`` interleaved runs, which filters out other load on the
machine), and each rdzv setup's throughput as a ratio of torch's. The
machine's load (``/proc/loadavg``, cores) is printed before and after. A run
whose clients have not all reported within ``CLIENT_TIMEOUT`` (a thrashing
machine) is killed and left out, with a line on stderr; a cell left without
any run shows ``n/a``.

A second table shows what one operation costs its client in CPU time
(``time.process_time()`` of the client process over its loop, divided by
its operations, the mean over the clients of the cell's best run): the
client's share of a request, which in a process of many agent threads is
what they pay per call before contending for the GIL.

``--before GIT_REF`` adds the server of an earlier commit (checked out into a
temporary git worktree, removed afterwards) on the standard library's loop,
driven by torch's client, so that the same run shows the server before and
after a change next to torch's.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from _common import ROOT, stamp, subprocess_env

OPS = ("set", "get", "add", "compare_set")
VALUE = b"v" * 100


def make_client(kind: str, port: int) -> Any:
    if kind == "torch":
        from datetime import timedelta

        import torch.distributed as dist

        return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    from rdzv.store.tcp import TCPStore

    return TCPStore("127.0.0.1", port, timeout=60)


def worker(kind: str, port: int, op: str, duration: float, start_at: float, index: int) -> None:
    store = make_client(kind, port)
    key = f"bench/{kind}/{op}/{index}"
    if op == "add":
        store.set(key, "0")
    else:
        store.set(key, VALUE)
    store.get(key)
    action = {
        "set": lambda: store.set(key, VALUE),
        "get": lambda: store.get(key),
        "add": lambda: store.add(key, 1),
        "compare_set": lambda: store.compare_set(key, VALUE, VALUE),
    }[op]
    time.sleep(max(0.0, start_at - time.time()))
    count = 0
    cpu = time.process_time()
    started = time.monotonic()
    end = started + duration
    while time.monotonic() < end:
        for _ in range(50):
            action()
        count += 50
    if op == "set":
        # Sets have no reply: the last ones may still wait in the socket's
        # buffers. The time runs until the server has taken them all.
        store.get(key)
    print(count, time.monotonic() - started, time.process_time() - cpu, flush=True)


def start_server(kind: str, source: Path | None = None) -> tuple[subprocess.Popen[str], int]:
    """Start torch's server (``torch``) or ``rdzv serve`` on the event loop ``kind``.

    ``source``: another tree's ``src`` directory to run ``rdzv serve`` from,
    on its default loop (``kind`` is then only its name).
    """
    environ = subprocess_env()
    if kind == "torch":
        code = (
            "import sys, time, torch.distributed as dist\n"
            "s = dist.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
            "print(f'listening on 127.0.0.1:{s.port}', flush=True)\n"
            "sys.stdin.read()\n"
        )
        cmd = [sys.executable, "-c", code]
    else:
        cmd = [sys.executable, "-m", "rdzv.cli", "serve", "--host", "127.0.0.1", "--port", "0"]
        if source is None:
            cmd += ["--loop", kind]
        else:
            environ["PYTHONPATH"] = os.pathsep.join([str(source), environ["PYTHONPATH"]])
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=environ
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    port = int(line.strip().rsplit(":", 1)[1].split()[0])
    return proc, port


def stop_server(proc: subprocess.Popen[str]) -> None:
    if proc.stdin is not None:
        proc.stdin.close()
    os.kill(proc.pid, signal.SIGTERM)
    proc.wait(30)
    if proc.stdout is not None:
        proc.stdout.close()


CLIENT_TIMEOUT = 120.0
"""Seconds a run's clients have to report; a run that overruns is left out."""


class Run(NamedTuple):
    """One run of a cell: its clients' summed ops/s and their mean CPU per op."""

    rate: float
    cpu_per_op: float


def measure(client: str, port: int, op: str, clients: int, duration: float) -> Run | None:
    """Return one run's figures, or None if a client hung (on a thrashing machine)."""
    start_at = time.time() + 1.0 + 0.3 * clients
    procs = []
    for index in range(clients):
        argv = [client, str(port), op, str(duration), str(start_at), str(index)]
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "--worker", *argv],
                stdout=subprocess.PIPE,
                text=True,
                env=subprocess_env(),
            )
        )
    total = 0.0
    cpu_per_op = 0.0
    deadline = time.monotonic() + CLIENT_TIMEOUT
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
            if proc.returncode != 0:
                raise RuntimeError(f"a {client} client failed on {op}")
            count, elapsed, cpu = out.split()
            total += int(count) / float(elapsed)
            cpu_per_op += float(cpu) / int(count) / clients
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
            proc.communicate()
        print(
            f"a {client} client on {op} ({clients} clients) did not finish within "
            f"{CLIENT_TIMEOUT:g} s: run left out",
            file=sys.stderr,
            flush=True,
        )
        return None
    return Run(total, cpu_per_op)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=2.0)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8])
    parser.add_argument(
        "--repeat", type=int, default=3, help="runs per cell; the best one is reported"
    )
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    parser.add_argument(
        "--loops",
        nargs="+",
        choices=("asyncio", "uvloop"),
        default=["asyncio", "uvloop"],
        help="event loops of the rdzv server, one column pair each (uvloop is left out "
        "when not installed)",
    )
    parser.add_argument(
        "--before",
        metavar="GIT_REF",
        help="also measure the rdzv server of this commit (asyncio, torch's client)",
    )
    parser.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, port, op, duration, start_at, index = args.worker
        worker(kind, int(port), op, float(duration), float(start_at), int(index))
        return

    # A SIGTERM unwinds like Ctrl-C, so the servers stop and --before's
    # worktree is removed.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    loops = list(args.loops)
    if "uvloop" in loops and importlib.util.find_spec("uvloop") is None:
        print("uvloop is not installed (the rdzv[fast] extra): measuring asyncio only\n")
        loops.remove("uvloop")
    # name: (server, client); the rdzv servers are named by their event loop.
    setups = {"torch": ("torch", "torch")}
    for loop in loops:
        setups[f"rdzv {loop}"] = (loop, "rdzv")
        setups[f"torch->rdzv {loop}"] = (loop, "torch")
    results: dict[tuple[str, str, int], Run] = {}
    sources: dict[str, Path | None] = dict.fromkeys(("torch", *loops))
    with contextlib.ExitStack() as stack:
        if args.before:
            setups["torch->before"] = ("before", "torch")
            sources["before"] = stack.enter_context(worktree(args.before)) / "src"
        stamp("start")
        run_cells(args, setups, sources, results)
    stamp("end")
    print()
    report(args, loops, results)


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def worktree(ref: str) -> Iterator[Path]:
    """Check ``ref`` out into a temporary git worktree; remove it afterwards."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "before"
        git = ["git", "-C", str(ROOT), "worktree"]
        subprocess.run([*git, "add", "--detach", str(tree), ref], check=True, capture_output=True)
        try:
            yield tree
        finally:
            subprocess.run([*git, "remove", "--force", str(tree)], check=False)


def run_cells(
    args: argparse.Namespace,
    setups: dict[str, tuple[str, str]],
    sources: dict[str, Path | None],
    results: dict[tuple[str, str, int], Run],
) -> None:
    """Start the servers (kind: source tree), measure every cell, stop the servers."""
    servers: dict[str, tuple[subprocess.Popen[str], int]] = {}
    try:
        for kind, source in sources.items():
            servers[kind] = start_server(kind, source)
        # Interleave the setups cell by cell so that a change in the machine's
        # load during the run affects every column alike.
        for clients in args.clients:
            for op in args.ops:
                for _ in range(args.repeat):
                    for name, (server_kind, client_kind) in setups.items():
                        port = servers[server_kind][1]
                        run = measure(client_kind, port, op, clients, args.duration)
                        cell = (name, op, clients)
                        if run is not None:
                            best = results.get(cell)
                            if best is None or run.rate > best.rate:
                                results[cell] = run
                            print(
                                f"{name}, {op}, {clients}: {run.rate:,.0f}/s, "
                                f"client CPU {run.cpu_per_op * 1e6:.1f} us/op",
                                file=sys.stderr,
                            )
    finally:
        for proc, _port in servers.values():
            stop_server(proc)


def report(
    args: argparse.Namespace, loops: list[str], results: dict[tuple[str, str, int], Run]
) -> None:
    """Print the tables: ops/s per setup with each rdzv setup's ratio to torch's, then client CPU."""
    import torch

    print(
        f"torch {torch.__version__}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, "
        f"best of {args.repeat} runs of {args.duration:g} s per cell, 100-byte values, "
        "ops/s summed over clients\n"
    )
    header = ["op", "clients", "torch server + torch client"]
    for loop in loops:
        header += [f"rdzv server ({loop}) + rdzv client", "ratio"]
    for loop in loops:
        header += [f"rdzv server ({loop}) + torch client", "ratio"]
    columns = [f"torch->rdzv {loop}" for loop in loops]
    if args.before:
        header += [f"rdzv server at {args.before} (asyncio) + torch client", "ratio"]
        columns.append("torch->before")
    print("| " + " | ".join(header) + " |")
    print("|---|" + "---:|" * (len(header) - 1))
    for clients in args.clients:
        for op in args.ops:
            torch_run = results.get(("torch", op, clients))
            base = None if torch_run is None else torch_run.rate
            row = [op, str(clients), "n/a" if base is None else f"{base:,.0f}"]
            for name in [f"rdzv {loop}" for loop in loops] + columns:
                run = results.get((name, op, clients))
                if run is None:
                    row += ["n/a", ""]
                else:
                    ratio = "" if base is None else f"{run.rate / base:.2f}x"
                    row += [f"{run.rate:,.0f}", ratio]
            print("| " + " | ".join(row) + " |")
    print("\nclient CPU per op (us), in the best run of each cell\n")
    clients_of = {"torch": "torch client"}
    clients_of.update({f"rdzv {loop}": f"rdzv client, rdzv server ({loop})" for loop in loops})
    print("| op | clients | " + " | ".join(clients_of.values()) + " |")
    print("|---|" + "---:|" * (len(clients_of) + 1))
    for clients in args.clients:
        for op in args.ops:
            cells = [results.get((name, op, clients)) for name in clients_of]
            row = [op, str(clients)]
            row += ["n/a" if run is None else f"{run.cpu_per_op * 1e6:.1f}" for run in cells]
            print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
