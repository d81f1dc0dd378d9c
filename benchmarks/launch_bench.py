"""Launcher overhead, side by side with torchrun.

For each launcher, runs ``--standalone --nproc-per-node N`` of a trivial
worker (examples/hello.py: prints its rank, does a store barrier through
MASTER_ADDR/MASTER_PORT, checks a sum) several times and prints the median
wall time from start to exit, and the ratio. Also times one failure and
restart (``--max-restarts 1`` with a worker that fails on its first attempt),
and growing a c10d group (two agents run ``--nnodes 2:3``, a third starts:
the time until all three workers run in a round of 3).

    python benchmarks/launch_bench.py [--runs 5] [--nproc 2]
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, NotReachedError, free_port, stamp, subprocess_env, wait_until

HELLO = ROOT / "examples" / "hello.py"

FAIL_ONCE = """
import os, sys
from pathlib import Path
marker = Path(sys.argv[1]) / ("failed-" + os.environ["RANK"])
if os.environ["RANK"] == "0" and not marker.exists():
    marker.write_text("x")
    sys.exit(3)
"""


GROW_WORKER = """
import os, sys, time
from pathlib import Path
out = Path(sys.argv[1])
world = os.environ["WORLD_SIZE"]
(out / f"started-{world}-{os.getpid()}").write_text(repr(time.time()))
deadline = time.monotonic() + 120
while not (out / "release").exists() and time.monotonic() < deadline:
    time.sleep(0.02)
"""


def wait_files(directory: Path, pattern: str, count: int) -> list[Path]:
    return wait_until(
        lambda: len(found := sorted(directory.glob(pattern))) >= count and found,
        f"{count} x {pattern}",
        60,
        every=0.01,
    )


def grow_latency(base: list[str], tmp: Path, tag: str) -> float:
    """Seconds from a third agent's start until all three workers run in a round of 3.

    NaN when the round of 3 did not start within 60 s.
    """
    out = tmp / f"grow-{tag}"
    out.mkdir()
    script = tmp / "grow_worker.py"
    script.write_text(GROW_WORKER)
    args = [
        *base,
        "--nnodes=2:3",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        f"--rdzv-id=grow-{tag}",
        "--rdzv-conf=last_call_timeout=1",
        "--monitor-interval=0.1",
        str(script),
        str(out),
    ]
    procs: list[subprocess.Popen[bytes]] = []

    def agent() -> None:
        procs.append(
            subprocess.Popen(
                args, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
        )

    try:
        agent()
        agent()
        wait_files(out, "started-2-*", 2)
        start = time.time()
        agent()
        try:
            started = wait_files(out, "started-3-*", 3)
        except NotReachedError:
            return math.nan
        latency = max(float(p.read_text()) for p in started) - start
        (out / "release").write_text("")
        for proc in procs:
            proc.wait(timeout=120)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return latency


def launchers() -> dict[str, list[str]]:
    found = {"rdzv run": [sys.executable, "-m", "rdzv.cli", "run"]}
    torchrun = shutil.which("torchrun")
    if torchrun:
        found["torchrun"] = [sys.executable, "-m", "torch.distributed.run"]
    return found


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{cmd} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    results: dict[str, dict[str, float]] = {}
    stamp("start")
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "fail_once.py"
        script.write_text(FAIL_ONCE)
        for name, base in launchers().items():
            common = [*base, "--standalone", f"--nproc-per-node={args.nproc}"]
            hello = [timed([*common, str(HELLO)]) for _ in range(args.runs)]
            restart = []
            for i in range(args.runs):
                scratch = Path(tmp) / f"{name.replace(' ', '_')}-{i}"
                scratch.mkdir()
                restart.append(timed([*common, "--max-restarts=1", str(script), str(scratch)]))
            grow: list[float] = []
            for i in range(args.runs):
                grow.append(grow_latency(base, Path(tmp), f"{name.replace(' ', '_')}-{i}"))
                if math.isnan(grow[-1]):
                    break  # it does not work with this launcher; once is enough
            results[name] = {
                "hello": statistics.median(hello),
                "restart": statistics.median(restart),
                "grow": math.nan if any(map(math.isnan, grow)) else statistics.median(grow),
            }
    stamp("end")
    print(f"median of {args.runs} runs, --standalone --nproc-per-node {args.nproc}")
    print("grow: 2 c10d agents running, a third starts; seconds until all 3 workers run")
    print("(nan: no round of 3 within 60 s)")
    print(f"{'launcher':<10} {'hello (s)':>10} {'fail+restart (s)':>17} {'grow (s)':>9}")
    for name, r in results.items():
        print(f"{name:<10} {r['hello']:>10.2f} {r['restart']:>17.2f} {r['grow']:>9.2f}")
    if "torchrun" in results:
        t, d = results["torchrun"], results["rdzv run"]
        print(
            f"torchrun / rdzv run: hello {t['hello'] / d['hello']:.2f}x, "
            f"fail+restart {t['restart'] / d['restart']:.2f}x, grow {t['grow'] / d['grow']:.2f}x"
        )


if __name__ == "__main__":
    main()
