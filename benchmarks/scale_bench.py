"""Rendezvous at scale: N real handlers over one store, phase by phase.

Run:  python benchmarks/scale_bench.py --n 256,1024,2048
      python benchmarks/scale_bench.py --n 64 --backends rdzv,torch,etcd,redis
      python benchmarks/scale_bench.py --n 1024 --scenarios recovery,scaleup
      python benchmarks/scale_bench.py --n 2048 --backends rdzv,floor --scenarios lastcall
      python benchmarks/scale_bench.py --n 2048 --backends etcd,etcd-floor,redis,redis-floor

What runs
---------
* The store server runs in its own process (rdzv's ``TCPStoreServer``, or
  torch's ``TCPStore`` master for the torch column); its CPU time is read
  from ``/proc/<pid>/stat`` before and after each phase. etcd and
  redis-server are private servers on loopback (``tests/engines/servers.py``),
  stopped by pid at the end.
* Agents run in several worker processes (``--per-proc`` handlers each; by
  default 128, or more so that a core runs at most 8 processes: see
  :func:`agents_per_process`), at ``--agent-nice`` 5, and the servers at
  niceness -20 when the benchmark runs as root, so that thousands of agent
  threads on the same two cores do not starve the store server, which on a
  cluster has a host of its own; one thread per handler, each handler with
  its own store client(s), its real keep-alive and real sockets. A handler
  that is to be killed runs alone in its own process, so SIGKILL takes
  exactly one agent.
* Every rdzv agent's store is wrapped by a counter: one request per store
  call, bytes written = keys and values sent, bytes read = values returned
  (payload, not framing). Phases are cut at the handler's own structured
  events (``enqueue``, ``complete``). torch's handler is counted on its
  backend's store only (its round store must be torch's C++ type); etcd and
  Redis are not counted.
* The floor columns (formation and last call only; ``benchmarks/scale_floors.py``)
  send rdzv's messages of one round from the same processes and threads
  to the same servers, with no handler: ``floor`` on the TCP store,
  ``etcd-floor`` and ``redis-floor`` through the backend and store rdzv's
  handler gets on that engine; what the harness and the messages cost by
  themselves, so that rdzv's figures can be read against the lowest this
  machine allows them. The ``-noconfirm`` floors leave out the round's
  confirmation (a write and the wait for the verdict a member). After the
  table, each column's figures are printed over its floor's of the same
  run.
* etcd runs ``--etcd-members`` members (3, as users run it); each node's
  client starts at a member drawn at random, and the server CPU is the
  members' sum.
* Dead-node judgements are the handlers' ``dead`` events; ``dead`` counts
  the nodes judged (a node two judges both judged, its ring judge and a
  seal waiting for it, counts once); a judgement of a node that was never
  killed is a *false death*.
* Keep-alive: torch's and rdzv's default interval (5 s) x ``--attempts``,
  except in recovery (1 s, so the dead-node bound is 3 s); ``--interval``
  sets it for every scenario (at 1 s the beats of thousands of simulated
  agents alone load one machine's cores).
* The agent processes run with a GIL switch interval of
  :data:`SWITCH_INTERVAL`: hundreds of threads in one interpreter are the
  harness's cost, not the handlers'.
* Each agent process runs on one core, the processes dealt round the cores
  (``--no-pin``: on any). A real agent is one process on its own host; here
  ``--per-proc`` agents share one GIL, which they hand to each other at
  every system call, and a thread woken on another core than the GIL's
  holder costs a cross-core wake-up, which pinning saves: it lowers the
  agents' CPU a node (most in the kernel) with the same handler code. The
  store server is not pinned.

Scenarios
---------
* formation: min = max = N, all released at one instant; phases: join (last
  enqueue), seal (the sealing write), address (the last member knowing the
  bootstrap address), completion (the last ``next_rendezvous`` returning).
* lastcall: min = N/2, max = N, N/2 join, last call ``--last-call``; the
  overhead is completion minus the last call, both from the common start
  (so the N/2 joins are part of it), and "after the last call" is the
  overhead minus the join phase: completion minus the moment the last call,
  which starts at the last (the N/2-th) enqueue, expired.
* recovery: N form (min = N-1, max = N, last call ``--last-call``, shorter than the dead-node bound); one agent is
  SIGKILLed; the survivors re-rendezvous at once (as an agent does when its
  workers lose a peer), so the next round waits for the dead one's
  judgement (phase judged: the first ``dead`` event); time from the kill
  until all N-1 completed.
* scaleup: N form (min = N, max = N+1, last call ``--last-call``); one more agent
  calls ``next_rendezvous``; members poll ``num_nodes_waiting()`` every
  ``--poll`` s (jittered) and re-rendezvous; time from that call until all
  N+1 completed, and from the last member's call ("all called") until then.
* steady: N form (min = max = N), then every member polls
  ``num_nodes_waiting()`` every ``--poll`` s (jittered; ``rdzv run`` polls
  every 0.1 s by default) for ``--steady`` s while nothing changes; per poll
  and agent, the requests and bytes it cost, and the store server's CPU per
  second of the window.

The machine's load (``/proc/loadavg``, cores) is printed before and after;
on a shared machine the figures are a shape, not a record.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from _common import cpu_seconds, load, make_handler, release, stamp, subprocess_env
from rdzv.api import DEFAULT_KEEP_ALIVE_INTERVAL
from scale_floors import FLOOR_OF, FLOOR_SCENARIOS, engine_of, floor_column, make_floor

BACKENDS = ("rdzv", "torch", "etcd", "redis", *FLOOR_OF)
SCENARIOS = ("formation", "lastcall", "recovery", "scaleup", "steady")
TORCH_MAX_N = 128
"""torch's handler is run up to this N (at 256 it livelocks on this machine)."""
SWITCH_INTERVAL = 0.1
"""The GIL switch interval of the agent processes (CPython's default is 5 ms).

Hundreds of handler threads share one interpreter here, where a real job
runs one per host. A thread waiting for the GIL wakes every switch interval;
at thousands of handlers those wake-ups alone made thousands of threads
runnable, the store server got a few percent of the CPU despite its
niceness, and watches went unanswered. The handlers
block on sockets, which releases the GIL at once, so a longer interval only
stops the waiters from spinning."""
MIN_PER_PROCESS = 128
"""The fewest handlers an agent process runs by default (64 made the last call slower)."""
PROCESSES_PER_CORE = 8
"""The most agent processes a core runs by default (see :func:`agents_per_process`)."""
RECOVERY_INTERVAL = 1.0
"""The keep-alive interval of the recovery scenario when ``--interval`` is not given."""

# --------------------------------------------------------------------------
# Counting (inside agent processes)
# --------------------------------------------------------------------------


class Counter:
    """Requests and payload bytes of one agent's store calls."""

    __slots__ = ("by_op", "polls", "read", "requests", "written")

    def __init__(self) -> None:
        self.requests = 0
        self.written = 0
        self.read = 0
        self.polls = 0
        self.by_op: dict[str, int] = {}

    def snapshot(self) -> tuple[int, int, int]:
        return self.requests, self.written, self.read

    def count(self, name: str, args: tuple[Any, ...], result: Any) -> None:
        """Count one store call (a :class:`CountingStore`'s count)."""
        self.requests += 1
        self.by_op[name] = self.by_op.get(name, 0) + 1
        self.written += _size(args)
        self.read += _size(result)


def _size(value: Any) -> int:
    if isinstance(value, (bytes, bytearray, str)):
        return len(value)
    if isinstance(value, (list, tuple)):
        return sum(map(_size, value))
    if isinstance(value, int):
        return 8
    return 0


# --------------------------------------------------------------------------
# Agents (inside worker processes)
# --------------------------------------------------------------------------

_local = threading.local()


class EventLog(logging.Handler):
    """Collects the handlers' structured events; cuts each agent's counters at its phases."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.guard = threading.Lock()
        self.sealed: list[float] = []
        self.judged: list[float] = []
        self.dead: list[str] = []
        self.cuts: dict[int, dict[str, tuple[float, int, int, int]]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        event = getattr(record, "rdzv_event", None)
        if event is None:
            return
        action = event["action"]
        now = time.time()
        with self.guard:
            if action == "sealed":
                self.sealed.append(now)
            elif action == "dead":
                self.dead.extend(event.get("suspects", []))
                self.judged.append(now)
        index = getattr(_local, "index", None)
        counter = getattr(_local, "counter", None)
        if index is not None and counter is not None and action in ("enqueue", "complete"):
            self.cuts.setdefault(index, {})[action] = (now, *counter.snapshot())


def agent_handler(impl: str, cfg: dict[str, Any], addr: str, counter: Counter) -> Any:
    floor = make_floor(impl, cfg, addr, counter.count)
    if floor is not None:
        return floor
    return make_handler(impl, {**cfg, "read_timeout": 120}, addr, counter.count)


def sample_stacks(stop: threading.Event, every: float = 0.01) -> None:
    """Print where this process's threads spend their time (``--sample``), on stderr."""
    import traceback

    seen: collections.Counter[str] = collections.Counter()
    me = threading.get_ident()
    while not stop.wait(every):
        for ident, frame in sys._current_frames().items():
            if ident != me:
                stack = traceback.extract_stack(frame, limit=4)
                seen[" <- ".join(f"{f.name}:{f.lineno}" for f in reversed(stack))] += 1
    total = sum(seen.values()) or 1
    for where, count in seen.most_common(25):
        print(f"{100 * count / total:5.1f}% {where}", file=sys.stderr)


def agent_process(impl: str, cfg: dict[str, Any]) -> None:
    """Run ``cfg['threads']`` handlers; report each round on stdout as one JSON line."""
    threading.stack_size(512 * 1024)
    # See SWITCH_INTERVAL: the harness's own cost, not the handlers'.
    sys.setswitchinterval(SWITCH_INTERVAL)
    # The servers run at a higher priority (see favour): on a cluster the
    # store host has its own CPU, which thousands of agent threads on the
    # same two cores would otherwise take from it.
    os.nice(cfg["nice"])
    if cfg["pin"]:
        # One core a process (see the module's header).
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[cfg["proc"] % len(cores)]})
    log = EventLog()
    logger = logging.getLogger("rdzv.dynamic")
    logger.setLevel(logging.INFO)
    logger.addHandler(log)
    logger.propagate = False
    count = cfg["threads"]
    counters = [Counter() for _ in range(count)]
    handlers = [
        agent_handler(impl, cfg, f"127.{cfg['proc'] // 250}.{cfg['proc'] % 250}.{i + 1}", c)
        for i, c in enumerate(counters)
    ]
    nodes = [getattr(h, "node", "") for h in handlers]
    print(json.dumps({"ready": True, "nodes": nodes}), flush=True)
    start_at = float(sys.stdin.readline().split()[1])
    rounds: int = cfg["rounds"]
    results: list[list[dict[str, Any]]] = [[{} for _ in handlers] for _ in range(rounds)]
    done = [threading.Semaphore(0) for _ in range(rounds)]
    stop = threading.Event()
    rejoin = threading.Event()
    closed = threading.Event()  # stdin's end: the driver is gone

    def commands() -> None:
        for line in sys.stdin:
            if line.startswith("rejoin"):
                rejoin.set()
            elif line.startswith("stop"):
                stop.set()
        stop.set()
        closed.set()

    threading.Thread(target=commands, daemon=True).start()

    def run(index: int, handler: Any) -> None:
        _local.index, _local.counter = index, counters[index]
        time.sleep(max(0.0, start_at - time.time()))
        for k in range(rounds):
            if k:
                # An agent's monitor loop: poll until someone waits (or the
                # driver says this agent's workers failed), then re-join.
                while not stop.is_set() and not rejoin.is_set():
                    try:
                        counters[index].polls += 1
                        if handler.num_nodes_waiting() > 0:
                            break
                    except Exception as exc:  # reported below
                        results[k][index] = {"error": f"{type(exc).__name__}: {exc}"}
                        done[k].release()
                        return
                    rejoin.wait(cfg["poll"] * (0.5 + random.random()))
                if stop.is_set():
                    results[k][index] = {"stopped": True}
                    done[k].release()
                    return
            begin = time.time()
            before = counters[index].snapshot()
            ops_before = dict(counters[index].by_op)
            try:
                info = handler.next_rendezvous()
                after = counters[index].snapshot()
                results[k][index] = {
                    "begin": begin,
                    "done": time.time(),
                    "rank": info.rank,
                    "world": info.world_size,
                    "before": before,
                    "ops": [a - b for a, b in zip(after, before, strict=True)],
                    # A copy: the keep-alive thread counts its calls in the
                    # same dict, and a first call of a kind adds a key.
                    "by_op": {
                        op: c - ops_before.get(op, 0)
                        for op, c in dict(counters[index].by_op).items()
                        if c > ops_before.get(op, 0)
                    },
                    "cuts": log.cuts.pop(index, {}),
                }
            except Exception as exc:  # reported to the driver
                results[k][index] = {"error": f"{type(exc).__name__}: {exc}"}
                done[k].release()
                return
            done[k].release()

    sampling = threading.Event()
    if cfg.get("sample") and cfg["proc"] == 0:
        threading.Thread(target=sample_stacks, args=(sampling,), daemon=True).start()
    cpu0, times0 = time.process_time(), os.times()
    threads = [
        threading.Thread(target=run, args=(i, h), daemon=True) for i, h in enumerate(handlers)
    ]
    for t in threads:
        t.start()
    for k in range(rounds):
        for _ in handlers:
            done[k].acquire()
        with log.guard:
            sealed, dead, judged = list(log.sealed), list(log.dead), list(log.judged)
        times = os.times()
        report = {
            "round": k,
            "results": results[k],
            "cpu": time.process_time() - cpu0,
            # The kernel's share: system calls, and switching hundreds of threads.
            "cpu_system": times.system - times0.system,
            "sealed": sealed,
            "judged": judged,
            "dead": dead,
        }
        print(json.dumps(report), flush=True)
        if any("error" in r or "stopped" in r for r in results[k]):
            break
    sampling.set()
    time.sleep(0.1 if cfg.get("sample") else 0)
    stop.wait()
    totals = [sum(c.snapshot()[i] for c in counters) for i in range(3)]
    with log.guard:
        final = {
            "dead": list(log.dead),
            "totals": totals,
            "polls": sum(c.polls for c in counters),
            "cpu": time.process_time() - cpu0,
        }
        print(json.dumps(final), flush=True)
    # Wait to be killed, or for the driver to go: the driver stops the store
    # server first, so that the connections' TIME-WAIT is on its side (see
    # Run.close). What the handlers' threads then report of the lost server
    # (torch's C++ client writes a stack per heartbeat to stderr) is no news.
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
    closed.wait()
    os._exit(0)


# --------------------------------------------------------------------------
# The store server process
# --------------------------------------------------------------------------


def server_process(impl: str, max_connections: int) -> None:
    """Serve a store on a free loopback port until stdin closes."""
    if impl == "torch":
        import torch.distributed as dist

        store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=600), wait_for_workers=False
        )
        print(store.port, flush=True)
        sys.stdin.read()
        return
    from rdzv.store.server import TCPStoreServer

    # Every simulated host connects from 127.0.0.1: no cap per address (the
    # default, three quarters of the slots, refused 8,192 nodes' clients).
    server = TCPStoreServer(
        "127.0.0.1", 0, max_connections=max_connections, max_connections_per_address=max_connections
    ).start()
    print(server.port, flush=True)
    sys.stdin.read()
    server.stop()


def agents_per_process(n: int) -> int:
    """Return how many of ``n`` handlers one agent process runs by default.

    At least :data:`MIN_PER_PROCESS`, and so many that no core runs more than
    :data:`PROCESSES_PER_CORE` agent processes. The kernel preempts a thread
    that holds its process's GIL like any other, and every agent of that
    process then waits until the thread runs again, behind the other
    processes of its core: with many processes a core, a formation at
    thousands of agents took about twice as long and varied twice as much,
    with the same handler code. A real agent has a host of its own.
    """
    cores = len(os.sched_getaffinity(0))
    return max(MIN_PER_PROCESS, -(-n // (PROCESSES_PER_CORE * cores)))


# --------------------------------------------------------------------------
# The driver
# --------------------------------------------------------------------------


def _spawn(argv: Sequence[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )


_UNREAD: dict[int, bytearray] = {}
"""What :func:`_readline` read from each process (by pid) past the line it returned."""


def _readline(proc: subprocess.Popen[str], deadline: float) -> str:
    """One line from ``proc`` by ``deadline`` (time.monotonic), or '' (also at its end).

    It reads the pipe itself: a ``select`` on the text stream would not see
    a line its buffer already holds (a process that writes two lines at
    once), and ``readline`` on it would block past the deadline for a line
    written in parts.
    """
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    unread = _UNREAD.setdefault(proc.pid, bytearray())
    while (end := unread.find(b"\n")) < 0:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return ""
        ready, _, _ = select.select([fd], [], [], min(remaining, 1.0))
        if ready:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                rest = unread.decode()
                unread.clear()
                return rest
            unread += chunk
    line = unread[: end + 1].decode()
    del unread[: end + 1]
    return line


def _stop(proc: subprocess.Popen[str]) -> None:
    """Stop a process this benchmark started, by pid."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    _UNREAD.pop(proc.pid, None)  # its pid may come again
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            stream.close()


SERVER_NICE = -20
"""The niceness given to the server processes (when this benchmark may raise priority)."""


def favour(pid: int) -> None:
    """Run a server process at :data:`SERVER_NICE`; unprivileged runs keep the default."""
    with contextlib.suppress(PermissionError):
        os.setpriority(os.PRIO_PROCESS, pid, SERVER_NICE)


class Run:
    """One scenario's server and agent processes."""

    def __init__(
        self, impl: str, endpoints: dict[str, str], opts: argparse.Namespace, interval: float
    ) -> None:
        self.impl = impl
        self.opts = opts
        self.procs: list[subprocess.Popen[str]] = []
        self.asked: list[subprocess.Popen[str]] = []
        self.finals: list[dict[str, Any]] = []
        self.dead: list[str] = []
        self.server: subprocess.Popen[str] | None = None
        self.base: dict[str, Any] = {
            "run_id": f"scale{random.getrandbits(32):08x}",
            "join": opts.join,
            "interval": interval,
            "attempts": opts.attempts,
            "poll": opts.poll,
            "two_clients": not opts.one_client,
            "sample": opts.sample,
            "nice": opts.agent_nice,
            "pin": not opts.no_pin,
            "etcd_client": opts.etcd_client,
        }
        engine = engine_of(impl)
        self.base["endpoint"] = endpoints.get(engine, "")
        # Every member of an etcd cluster: their CPU is summed.
        self.server_pids = [int(p) for p in endpoints.get(f"{engine}-pid", "").split(",") if p]
        if engine in ("rdzv", "torch"):
            server = "torch" if impl == "torch" else "rdzv"
            self.server = _spawn(["--server", server, str(opts.max_connections)])
            line = _readline(self.server, time.monotonic() + 60)
            if not line:
                raise RuntimeError(f"the {impl} store server did not start")
            self.base["port"] = int(line)
            self.server_pids = [self.server.pid]
        for pid in self.server_pids:
            favour(pid)

    def server_cpu(self) -> float:
        """The CPU seconds the run's servers have spent (NaN: no server known)."""
        return sum(map(cpu_seconds, self.server_pids)) if self.server_pids else float("nan")

    def spawn(self, n: int, per_proc: int | None, **cfg: Any) -> list[subprocess.Popen[str]]:
        if per_proc is None:
            per_proc = agents_per_process(n)
        sizes = [min(per_proc, n - i) for i in range(0, n, per_proc)]
        group = []
        for size in sizes:
            config = {**self.base, **cfg, "threads": size, "proc": len(self.procs)}
            proc = _spawn(["--agent", self.impl, json.dumps(config)])
            self.procs.append(proc)
            group.append(proc)
        return group

    def ready(self, group: Sequence[subprocess.Popen[str]]) -> list[str]:
        nodes: list[str] = []
        deadline = time.monotonic() + 600
        for proc in group:
            line = _readline(proc, deadline)
            if not line:
                raise RuntimeError(f"a {self.impl} agent process did not start")
            nodes.extend(json.loads(line)["nodes"])
        return nodes

    def collect(self, group: Sequence[subprocess.Popen[str]]) -> list[dict[str, Any]]:
        deadline = time.monotonic() + self.opts.join + 60
        reports = []
        for proc in group:
            line = _readline(proc, deadline)
            reports.append(json.loads(line) if line else {"error": "no report (timed out)"})
        return reports

    def stop_agents(self) -> None:
        """Tell the agent processes to stop; keep their final reports and dead judgements.

        The final reports (each process's counters at the stop) go to
        ``finals``, the judgements to ``dead``; a process is asked once.
        """
        live = [
            p
            for p in self.procs
            if p.poll() is None and p.stdin is not None and p not in self.asked
        ]
        self.asked.extend(live)
        for proc in live:
            assert proc.stdin is not None
            with contextlib.suppress(OSError):
                proc.stdin.write("stop\n")
                proc.stdin.flush()
        deadline = time.monotonic() + 60
        for proc in live:
            while line := _readline(proc, deadline):
                report = json.loads(line)
                if "round" not in report:
                    self.dead.extend(report.get("dead", []))
                    self.finals.append(report)
                    break

    def close(self) -> list[str]:
        """Stop everything; return every dead judgement the agents made.

        The store server goes first: the side that closes a connection
        first keeps it in TIME-WAIT for a minute, and on the server's side
        that holds only the server's port, where on the agents' side it
        would hold one of this host's ephemeral ports per connection (after
        one run at 8,192 nodes, 16,384 of its 28,232, and the next run's
        nodes could not bind their bootstrap ports: ``EADDRINUSE``).
        """
        self.stop_agents()
        if self.server is not None:
            _stop(self.server)
            time.sleep(0.5)  # the agents' kernels take the server's FINs
        for proc in self.procs:
            _stop(proc)
        return self.dead


def summarise(reports: Sequence[dict[str, Any]], start: float, server_cpu: float) -> dict[str, Any]:
    """Turn the agent processes' reports of one round into the phase figures."""
    results = [r for rep in reports for r in rep.get("results", [])]
    errors = [r["error"] for r in results if "error" in r]
    errors += [rep["error"] for rep in reports if "error" in rep]
    if errors or not results:
        # The rarest error first: one node's failure often fails the others.
        ranked = sorted(collections.Counter(errors).items(), key=lambda kv: kv[1])
        text = "; ".join(f"{count} x {error}" for error, count in ranked) or "no results"
        return {"error": text, "failed": len(errors)}
    n = len(results)
    ranks = sorted(r["rank"] for r in results)
    if ranks != list(range(n)) or {r["world"] for r in results} != {n}:
        return {"error": f"inconsistent ranks or world sizes over {n} agents"}
    sealed = [t for rep in reports for t in rep.get("sealed", []) if t >= start]
    cuts = [r.get("cuts", {}) for r in results]
    enq = [c["enqueue"] for c in cuts if "enqueue" in c]
    comp = [c["complete"] for c in cuts if "complete" in c]
    ops = [sum(r["ops"][i] for r in results) / n for i in range(3)]
    out: dict[str, Any] = {
        "n": n,
        "completion": max(r["done"] for r in results) - start,
        "requests": ops[0],
        "written": ops[1],
        "read": ops[2],
        "agent_cpu_ms": 1000 * sum(rep["cpu"] for rep in reports) / n,
        "agent_system_ms": 1000 * sum(rep["cpu_system"] for rep in reports) / n,
        "server_cpu_ms": 1000 * server_cpu / n,
    }
    by_op: collections.Counter[str] = collections.Counter()
    for r in results:
        by_op.update(r.get("by_op", {}))
    out["by_op"] = {op: count / n for op, count in by_op.items()}
    # The last next_rendezvous call (members that poll call late in a scale-up).
    out["called"] = max(r["begin"] for r in results) - start
    if enq:
        out["join"] = max(c[0] for c in enq) - start
    if sealed:
        out["seal"] = min(sealed) - start
    judged = [t for rep in reports for t in rep.get("judged", []) if t >= start]
    if judged:
        out["judged"] = min(judged) - start
    if comp:
        out["address"] = max(c[0] for c in comp) - start
    if len(enq) == len(comp) == n:
        # Per agent, [requests, written, read] before its enqueue, from it
        # until it knew its rank and bootstrap address, and after.
        phases = [[0.0] * 3 for _ in range(3)]
        for r in results:
            before, e, k = r["before"], r["cuts"]["enqueue"][1:], r["cuts"]["complete"][1:]
            for i in range(3):
                phases[0][i] += (e[i] - before[i]) / n
                phases[1][i] += (k[i] - e[i]) / n
                phases[2][i] += (before[i] + r["ops"][i] - k[i]) / n
        out["phases"] = phases
    return out


def formation(run: Run, n: int, opts: argparse.Namespace, **cfg: Any) -> dict[str, Any]:
    group = run.spawn(n, opts.per_proc, rounds=1, **cfg)
    run.ready(group)
    cpu0 = run.server_cpu()
    start = release(group, 0.5)
    reports = run.collect(group)
    return summarise(reports, start, run.server_cpu() - cpu0)


def membership_change(run: Run, n: int, opts: argparse.Namespace, kill: bool) -> dict[str, Any]:
    """Form N, then SIGKILL one agent (kill) or add one (scale-up); time the next round."""
    common = {"last_call": opts.last_call, "rounds": 2}
    if kill:
        group = run.spawn(n - 1, opts.per_proc, min=n - 1, max=n, **common)
        victim = run.spawn(1, 1, min=n - 1, max=n, **common)
        everyone = group + victim
    else:
        group = run.spawn(n, opts.per_proc, min=n, max=n + 1, **common)
        everyone = group
    run.ready(group)
    killed = run.ready(victim) if kill else []
    start = release(everyone, 0.5)
    first = summarise(run.collect(everyone), start, 0.0)
    if "error" in first:
        return {"error": f"initial formation: {first['error']}"}
    cpu0 = run.server_cpu()
    if kill:
        os.kill(victim[0].pid, signal.SIGKILL)
        begin = time.time()
        # The survivors' workers lost a peer: their agents re-rendezvous at once.
        for proc in group:
            assert proc.stdin is not None
            proc.stdin.write("rejoin\n")
            proc.stdin.flush()
        second = run.collect(group)
        bound = run.base["interval"] * opts.attempts
    else:
        late = run.spawn(1, 1, min=n, max=n + 1, last_call=opts.last_call, rounds=1)
        run.ready(late)
        begin = release(late, 0.2)
        second = run.collect(group + late)
        bound = 0.0
    summary = summarise(second, begin, run.server_cpu() - cpu0)
    summary["initial_formation"] = first["completion"]
    summary["bound"] = bound
    summary["killed"] = killed
    return summary


def steady(run: Run, n: int, opts: argparse.Namespace) -> dict[str, Any]:
    """Form N, let every member poll ``num_nodes_waiting()`` for ``--steady`` s; cost per poll."""
    group = run.spawn(n, opts.per_proc, min=n, max=n, last_call=30.0, rounds=2)
    run.ready(group)
    start = release(group, 0.5)
    reports = run.collect(group)
    first = summarise(reports, start, 0.0)
    if "error" in first:
        return {"error": f"formation: {first['error']}"}
    results = [r for rep in reports for r in rep["results"]]
    formed = [sum(r["before"][i] + r["ops"][i] for r in results) for i in range(3)]
    cpu_formed = sum(rep["cpu"] for rep in reports)
    cpu0, began = run.server_cpu(), time.monotonic()
    time.sleep(opts.steady)
    server = run.server_cpu() - cpu0
    window = time.monotonic() - began
    run.stop_agents()
    finals = run.finals
    polls = sum(f["polls"] for f in finals)
    if len(finals) != len(group) or not polls:
        return {
            "error": f"{len(group) - len(finals)} of {len(group)} agent processes gave no final "
            f"report ({polls} polls)",
        }
    totals = [sum(f["totals"][i] for f in finals) - formed[i] for i in range(3)]
    agent_cpu = sum(f["cpu"] for f in finals) - cpu_formed
    return {
        "n": n,
        "formation": first["completion"],
        "polls": polls,
        "poll_requests": totals[0] / polls,
        "poll_written": totals[1] / polls,
        "poll_read": totals[2] / polls,
        "agent_cpu_us_per_poll": 1e6 * agent_cpu / polls,
        "server_cpu_per_s": server / window,
    }


def run_scenario(
    impl: str, scenario: str, n: int, endpoints: dict[str, str], opts: argparse.Namespace
) -> dict[str, Any]:
    interval = opts.interval
    if interval is None:
        interval = RECOVERY_INTERVAL if scenario == "recovery" else DEFAULT_KEEP_ALIVE_INTERVAL
    run = Run(impl, endpoints, opts, interval)
    try:
        if scenario == "formation":
            result = formation(run, n, opts, min=n, max=n, last_call=30.0)
        elif scenario == "lastcall":
            half = max(1, n // 2)
            result = formation(run, half, opts, min=half, max=n, last_call=opts.last_call)
            if "completion" in result:
                result["overhead"] = result["completion"] - opts.last_call
                if "join" in result:
                    # The leader (position N/2, the last to join) starts the
                    # last call at its enqueue: what comes after it expired.
                    result["after_last_call"] = result["overhead"] - result["join"]
        elif scenario == "steady":
            result = steady(run, n, opts)
        else:
            result = membership_change(run, n, opts, kill=scenario == "recovery")
    except Exception as exc:  # one failed cell does not end the table
        result = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        dead = run.close()
    killed = set(result.pop("killed", []))
    result["dead"] = len(set(dead))
    result["false_deaths"] = len(set(dead) - killed)
    return result


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}{unit}" if value < 100 else f"{value:.0f}{unit}"
    return f"{value}{unit}"


def print_row(impl: str, scenario: str, n: int, r: dict[str, Any], show_ops: bool) -> None:
    if "error" in r:
        print(f"{scenario:9} {impl:5} N={n:<5} FAILED: {r['error'][:600]}", flush=True)
        return
    if scenario == "steady":
        print(
            f"{scenario:9} {impl:5} N={n:<5} | formed in {_fmt(r['formation'], 's')} | "
            f"{r['polls']} polls | per poll: req {_fmt(r['poll_requests'])} "
            f"wr {_fmt(r['poll_written'], 'B')} rd {_fmt(r['poll_read'], 'B')} "
            f"agent cpu {_fmt(r['agent_cpu_us_per_poll'], 'us')} | "
            f"server cpu {_fmt(r['server_cpu_per_s'], 's')}/s | "
            f"dead {r['dead']} false {r['false_deaths']}",
            flush=True,
        )
        return
    fields = [
        f"{scenario:9} {impl:5} N={n:<5}",
        f"join {_fmt(r.get('join'), 's')}",
        *([f"judged {_fmt(r['judged'], 's')}"] if "judged" in r else []),
        f"seal {_fmt(r.get('seal'), 's')}",
        f"addr {_fmt(r.get('address'), 's')}",
        f"done {_fmt(r.get('completion'), 's')}",
    ]
    if "overhead" in r:
        fields.append(f"overhead {_fmt(r['overhead'], 's')}")
        if "after_last_call" in r:
            fields.append(f"after the last call {_fmt(r['after_last_call'], 's')}")
    if "initial_formation" in r:
        fields.append(
            f"all called {_fmt(r['called'], 's')}, done "
            f"{_fmt(r['completion'] - r['called'], 's')} after"
        )
        fields.append(
            f"(formed first in {_fmt(r['initial_formation'], 's')}, bound {r['bound']:g}s)"
        )
    fields += [
        f"req/agent {_fmt(r['requests'])}",
        f"wr {_fmt(r['written'], 'B')}",
        f"rd {_fmt(r['read'], 'B')}",
        f"agent cpu {_fmt(r['agent_cpu_ms'], 'ms')}/node ({_fmt(r['agent_system_ms'], 'ms')} system)",
        f"server cpu {_fmt(r['server_cpu_ms'], 'ms')}/node",
        f"dead {r['dead']} false {r['false_deaths']}",
    ]
    print(" | ".join(fields), flush=True)
    if show_ops and r.get("by_op"):
        ops = sorted(r["by_op"].items(), key=lambda kv: -kv[1])
        print("  requests/agent by call: " + ", ".join(f"{op} {c:.3g}" for op, c in ops))


RATIOS = {
    "formation": ("completion", "done"),
    "lastcall": ("overhead", "overhead"),
}
"""Per scenario, the figure a column is compared to its floor on, and its label."""


def print_ratios(rows: Sequence[dict[str, Any]]) -> None:
    """Print each column's figures over its floor's of the same run, N and scenario."""
    found = {(r["impl"], r["scenario"], r["n"]): r for r in rows if "error" not in r}
    lines = []
    for (impl, scenario, n), r in found.items():
        floor = found.get((floor_column(impl) or "", scenario, n))
        if floor is None or scenario not in RATIOS:
            continue
        key, label = RATIOS[scenario]
        pairs = [
            (label, key),
            ("agent cpu", "agent_cpu_ms"),
            ("server cpu", "server_cpu_ms"),
        ]
        if "after_last_call" in r and "after_last_call" in floor:
            pairs.insert(1, ("after the last call", "after_last_call"))
        ratios = [f"{name} {r[k] / floor[k]:.2f}x" for name, k in pairs if floor.get(k)]
        lines.append(f"{scenario:9} {impl:5} N={n:<5} over {floor['impl']}: " + " | ".join(ratios))
    if lines:
        print("ratios to the floor (same run):", *lines, sep="\n", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", default="256,1024,2048", help="comma-separated N")
    parser.add_argument("--backends", default="rdzv,torch", help=f"of {','.join(BACKENDS)}")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument(
        "--per-proc",
        type=int,
        default=None,
        help=f"handlers per agent process (default: at least {MIN_PER_PROCESS}, and at most "
        f"{PROCESSES_PER_CORE} processes a core)",
    )
    parser.add_argument(
        "--interval",
        type=float,
        default=None,
        help=f"keep-alive interval (s); {RECOVERY_INTERVAL:g} for recovery, else "
        f"{DEFAULT_KEEP_ALIVE_INTERVAL:g} (torch's and rdzv's default)",
    )
    parser.add_argument("--attempts", type=int, default=3, help="keep-alive max attempts")
    parser.add_argument("--last-call", type=float, default=1.0)
    parser.add_argument("--poll", type=float, default=0.5, help="members' poll period (s)")
    parser.add_argument("--join", type=float, default=300.0, help="join timeout (s)")
    parser.add_argument("--steady", type=float, default=10.0, help="steady window (s)")
    parser.add_argument(
        "--agent-nice", type=int, default=5, help="niceness of the agent processes (5)"
    )
    parser.add_argument("--no-pin", action="store_true", help="let agent processes run on any core")
    parser.add_argument("--one-client", action="store_true", help="one store client per node")
    parser.add_argument("--max-connections", type=int, default=65536)
    parser.add_argument(
        "--etcd-client", default="auto", help="the etcd backend's client: auto, grpc or gateway"
    )
    parser.add_argument(
        "--sample", action="store_true", help="print where the first agent process's threads are"
    )
    parser.add_argument(
        "--ops", action="store_true", help="also print each agent's requests by store call"
    )
    parser.add_argument(
        "--etcd-members", type=int, default=3, help="members of the private etcd cluster (3)"
    )
    parser.add_argument("--json", help="also write the results to this file")
    opts = parser.parse_args(argv)
    sizes = [int(x) for x in opts.n.split(",")]
    backends = [b for b in opts.backends.split(",") if b]
    scenarios = [s for s in opts.scenarios.split(",") if s]
    for name in backends + scenarios:
        if name not in BACKENDS + SCENARIOS:
            raise ValueError(f"unknown backend or scenario {name!r}")
    stamp("start")
    rows: list[dict[str, Any]] = []
    from tests.engines.servers import engine_servers

    with engine_servers(backends, opts.etcd_members) as endpoints:
        for n in sizes:
            for scenario in scenarios:
                for impl in backends:
                    if impl == "torch" and n > TORCH_MAX_N:
                        continue
                    if impl in FLOOR_OF and scenario not in FLOOR_SCENARIOS:
                        continue
                    result = run_scenario(impl, scenario, n, endpoints, opts)
                    result["load_after"] = load()
                    print_row(impl, scenario, n, result, opts.ops)
                    rows.append({"impl": impl, "scenario": scenario, "n": n, **result})
    stamp("end")
    print_ratios(rows)
    if opts.json:
        Path(opts.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--agent":
        agent_process(sys.argv[2], json.loads(sys.argv[3]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--server":
        server_process(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit(main())
