"""Warm restarts: time from starting a restarted worker to its first training step.

Three ``rdzv run`` agents (c10d on loopback, ``--nnodes 3``, one worker
each, ``--max-restarts 3``) run a gloo DDP job. Once every worker trained
and the spares had time to preload (``--settle`` seconds), the benchmark
SIGKILLs rank 0's worker; every agent then starts its worker again. For each
restarted worker it measures the time from the agent's "starting workers"
line of that attempt to the end of the worker's first optimizer step (which
waits for all three ranks: gloo's connection set-up and DDP's first
broadcast). Three modes, alternating, ``--runs`` times each: warm (the
default), warm with ``--warm-preload torch._dynamo`` (DistributedDataParallel
imports it when it is built), and cold (``--no-warm-restart``). Also: the first attempt's start to first step (what the spares,
preloading while it runs, cost it), and SIGKILL to the last rank's first
step.

    python benchmarks/warm_bench.py [--runs 3] [--settle 20]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import free_port, stamp, subprocess_env, wait_until

WORKER = """
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

out = Path(sys.argv[1])
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank = dist.get_rank()
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Linear(64, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
release = out / "release"
deadline = time.monotonic() + 300
steps = 0
while time.monotonic() < deadline:
    optimizer.zero_grad()
    model(torch.randn(16, 64) + rank).sum().backward()
    optimizer.step()
    steps += 1
    if steps == 1:
        record = {"rank": rank, "pid": os.getpid(), "t": time.time()}
        (out / f"first-{os.getpid()}.json").write_text(json.dumps(record))
    stop = torch.tensor([1.0 if release.exists() else 0.0])
    dist.all_reduce(stop, op=dist.ReduceOp.MAX)
    if stop.item() > 0:
        break
    time.sleep(0.05)
del model, optimizer
dist.destroy_process_group()
os._exit(0)
"""

NODES = 3


def starts(log: Path) -> list[float]:
    """The times of the agent's "starting workers" lines (seconds since the epoch)."""
    found = []
    for line in log.read_text(errors="replace").splitlines():
        if " rdzv run: node " in line and " starting workers " in line:
            stamp_text = line[:23]
            seconds = time.mktime(time.strptime(stamp_text[:19], "%Y-%m-%d %H:%M:%S"))
            found.append(seconds + int(stamp_text[20:23]) / 1000)
    return found


def firsts(out: Path) -> dict[int, dict[str, float]]:
    records = [json.loads(t) for p in out.glob("first-*.json") if (t := p.read_text())]
    return {int(r["pid"]): r for r in records}


MODES = {
    "warm": [],
    "warm + torch._dynamo": ["--warm-preload=torch._dynamo"],
    "cold": ["--no-warm-restart"],
}


def one_run(tmp: Path, tag: str, options: list[str], settle: float) -> dict[str, list[float]]:
    out = tmp / tag
    out.mkdir()
    script = out / "ddp_train.py"
    script.write_text(WORKER)
    port = free_port()
    common = [
        sys.executable,
        "-m",
        "rdzv.cli",
        "run",
        f"--nnodes={NODES}",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id=warm-{tag}",
        "--rdzv-conf=last_call_timeout=0.5",
        "--local-addr=127.0.0.1",
        "--monitor-interval=0.05",
        "--max-restarts=3",
        *options,
        str(script),
        str(out),
    ]
    procs = []
    logs = [out / f"agent-{i}.log" for i in range(NODES)]
    try:
        for i, log in enumerate(logs):
            conf = ["--rdzv-conf=is_host=true,last_call_timeout=0.5"] if i == 0 else []
            with log.open("w") as file:
                procs.append(
                    subprocess.Popen(
                        [*common, *conf], env=subprocess_env(), stdout=file, stderr=file
                    )
                )
        first = wait_until(lambda: len(found := firsts(out)) >= NODES and found, "first steps", 180)
        time.sleep(settle)
        victim = next(pid for pid, r in first.items() if r["rank"] == 0)
        killed = time.time()
        os.kill(victim, signal.SIGKILL)
        again = wait_until(
            lambda: (
                len(new := {p: r for p, r in firsts(out).items() if p not in first}) >= NODES
                and new
            ),
            "first steps after the restart",
            180,
        )
        (out / "release").write_text("")
        for proc in procs:
            proc.wait(timeout=120)
        node_starts = [starts(log) for log in logs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    initial = [r["t"] - min(s[0] for s in node_starts) for r in first.values()]
    restarted = []
    for record in again.values():
        # The restarted worker's attempt: the last start of an agent before its first step.
        begun = max(t for s in node_starts for t in s if t < record["t"] and t > killed)
        restarted.append(record["t"] - begun)
    return {
        "initial": initial,
        "restarted": restarted,
        "recovery": [max(r["t"] for r in again.values()) - killed],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--settle", type=float, default=20.0)
    args = parser.parse_args()
    results: dict[str, dict[str, list[float]]] = {
        mode: {"initial": [], "restarted": [], "recovery": []} for mode in MODES
    }
    stamp("start")
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            for n, (mode, options) in enumerate(MODES.items()):
                run = one_run(Path(tmp), f"{n}-{i}", options, args.settle)
                for key, values in run.items():
                    results[mode][key].extend(values)
                print(
                    f"run {i} {mode}: " + ", ".join(f"{k} {max(v):.2f} s" for k, v in run.items())
                )
    stamp("end")
    print(f"{NODES} nodes x 1 gloo DDP worker, rank 0's worker SIGKILLed; {args.runs} runs each")
    print(
        f"{'':<20} {'restarted start -> first step (max)':>36} {'kill -> all stepped':>20} "
        f"{'first attempt start -> step':>28}"
    )
    for mode, r in results.items():
        print(
            f"{mode:<20} {statistics.median(r['restarted']):>23.2f} s ({max(r['restarted']):.2f} s) "
            f"{statistics.median(r['recovery']):>18.2f} s {statistics.median(r['initial']):>26.2f} s"
        )


if __name__ == "__main__":
    main()
