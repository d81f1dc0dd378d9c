"""The same torchrun job with ``--rdzv-backend=c10d`` (torch's) and ``--rdzv-backend=rdzv``.

Run:  python benchmarks/torchrun_bench.py [--repeats 3] [--nodes 2] [--nproc 2]

Each repetition launches ``--nodes`` torchrun agents on loopback
(``python -m torch.distributed.run``, ``--nproc-per-node=--nproc``,
``--monitor-interval=0.2``, ``last_call_timeout=1``) running a worker that
writes a marker file as its first statement (before importing torch) and
then waits for a gate file. Measured, median over the repetitions:

* start: from launching the agents until every worker of the job runs
  (agent start-up, rendezvous, rank assignment, worker spawn);
* restart: from SIGKILL of one worker until every worker of the next round
  runs (torch's agent notices the failure, both agents re-rendezvous: the
  failed one directly, the other when ``num_nodes_waiting()`` tells it).

Then the gate opens and the job ends. rdzv is found through its
``torchrun.handlers`` entry points: install rdzv (``pip install -e .``) or
the benchmark adds a temporary dist-info holding them.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from _common import free_port, read_markers, stamp, subprocess_env, wait_until

WORKER = """\
import json, os, sys, time
from pathlib import Path
out = Path(os.environ["BENCH_OUT"])
marker = {"pid": os.getpid(), "rank": int(os.environ["RANK"]), "t": time.time()}
(out / f"started-{os.getpid()}").write_text(json.dumps(marker))
deadline = time.monotonic() + 120
while not Path(os.environ["BENCH_GATE"]).exists() and time.monotonic() < deadline:
    time.sleep(0.05)
"""

ENTRY_POINTS = (
    "[torchrun.handlers]\n"
    "rdzv = rdzv.torchrun:tcp_creator\n"
    "rdzv-etcd = rdzv.torchrun:etcd_creator\n"
    "rdzv-redis = rdzv.torchrun:redis_creator\n"
)


def environment(tmp: Path) -> dict[str, str]:
    env = subprocess_env(OMP_NUM_THREADS="1")
    if "rdzv" not in {ep.name for ep in metadata.entry_points(group="torchrun.handlers")}:
        info = tmp / "eps" / "rdzv_torchrun_bench-0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: rdzv-torchrun-bench\nVersion: 0\n"
        )
        (info / "entry_points.txt").write_text(ENTRY_POINTS)
        env["PYTHONPATH"] += os.pathsep + str(tmp / "eps")
    return env


def markers(out: Path) -> list[dict[str, Any]]:
    return read_markers(out, "started-*")


def wait_for(predicate: Callable[[], Any], agents: list[subprocess.Popen[bytes]], what: str) -> Any:
    """:func:`wait_until` ``predicate`` (120 s), given up as soon as an agent failed."""
    return wait_until(
        predicate,
        what,
        120,
        every=0.01,
        broken=lambda: [a.args for a in agents if a.poll() not in (None, 0)],
    )


def one_run(
    backend: str, nodes: int, nproc: int, tmp: Path, env: dict[str, str]
) -> tuple[float, float]:
    run = tmp / uuid.uuid4().hex
    out = run / "out"
    out.mkdir(parents=True)
    gate = run / "gate"
    worker = run / "worker.py"
    worker.write_text(WORKER)
    world = nodes * nproc
    args = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nodes}",
        f"--nproc-per-node={nproc}",
        f"--rdzv-backend={backend}",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        f"--rdzv-id={uuid.uuid4().hex}",
        "--rdzv-conf=join_timeout=60,last_call_timeout=1,keep_alive_interval=1",
        "--max-restarts=3",
        "--monitor-interval=0.2",
        str(worker),
    ]
    agent_env = {**env, "BENCH_OUT": str(out), "BENCH_GATE": str(gate)}
    agents: list[subprocess.Popen[bytes]] = []
    try:
        t0 = time.time()
        agents.extend(
            subprocess.Popen(
                args,
                env=agent_env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            for _ in range(nodes)
        )
        first = wait_for(lambda: len(markers(out)) == world and markers(out), agents, "start")
        start = max(m["t"] for m in first) - t0
        victim = max(first, key=lambda m: m["rank"])
        old = {m["pid"] for m in first}
        t_kill = time.time()
        os.kill(int(victim["pid"]), signal.SIGKILL)
        fresh = wait_for(
            lambda: (
                [m for m in markers(out) if m["pid"] not in old][-world:]
                if len([m for m in markers(out) if m["pid"] not in old]) == world
                else None
            ),
            agents,
            "restart",
        )
        restart = max(m["t"] for m in fresh) - t_kill
        gate.touch()
        for agent in agents:
            if agent.wait(timeout=60) != 0:
                raise RuntimeError(f"{backend}: an agent exited with {agent.returncode}")
        return start, restart
    finally:
        gate.touch()
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    results: dict[str, dict[str, float]] = {}
    stamp("start")
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        env = environment(tmp)
        for backend in ("c10d", "rdzv"):
            runs = [one_run(backend, args.nodes, args.nproc, tmp, env) for _ in range(args.repeats)]
            results[backend] = {
                "start": statistics.median(r[0] for r in runs),
                "restart": statistics.median(r[1] for r in runs),
            }
    stamp("end")
    print(
        f"torchrun, {args.nodes} agents x {args.nproc} workers on loopback, "
        f"median of {args.repeats}"
    )
    print(f"| {'measure':<40} | {'c10d (torch)':>12} | {'rdzv':>8} | {'c10d / rdzv':>11} |")
    print(f"|{'-' * 42}|{'-' * 14}:|{'-' * 9}:|{'-' * 12}:|")
    labels = {
        "start": "launch -> all workers running",
        "restart": "worker SIGKILL -> all running again",
    }
    for key, label in labels.items():
        c10d, ours = results["c10d"][key], results["rdzv"][key]
        print(f"| {label:<40} | {c10d:>10.2f} s | {ours:>6.2f} s | {c10d / ours:>10.2f}x |")


if __name__ == "__main__":
    main()
