"""Launcher overhead, side by side with torchrun.

For each launcher, runs ``--standalone --nproc-per-node N`` of a trivial
worker (examples/hello.py: prints its rank, does a store barrier through
MASTER_ADDR/MASTER_PORT, checks a sum) several times and prints the median
wall time from start to exit, and the ratio. Also times one failure and
restart (``--max-restarts 1`` with a worker that fails on its first attempt).

    python benchmarks/launch_bench.py [--runs 5] [--nproc 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HELLO = ROOT / "examples" / "hello.py"

FAIL_ONCE = """
import os, sys
from pathlib import Path
marker = Path(sys.argv[1]) / ("failed-" + os.environ["RANK"])
if os.environ["RANK"] == "0" and not marker.exists():
    marker.write_text("x")
    sys.exit(3)
"""


def launchers() -> dict[str, list[str]]:
    found = {"rdzv run": [sys.executable, "-m", "rdzv.cli", "run"]}
    torchrun = shutil.which("torchrun")
    if torchrun:
        found["torchrun"] = [sys.executable, "-m", "torch.distributed.run"]
    return found


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), e.get("PYTHONPATH", "")])
    return e


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env(), capture_output=True, text=True, check=False)
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
            results[name] = {
                "hello": statistics.median(hello),
                "restart": statistics.median(restart),
            }
    print(f"median of {args.runs} runs, --standalone --nproc-per-node {args.nproc}")
    print(f"{'launcher':<10} {'hello (s)':>10} {'fail+restart (s)':>17}")
    for name, r in results.items():
        print(f"{name:<10} {r['hello']:>10.2f} {r['restart']:>17.2f}")
    if "torchrun" in results:
        t, d = results["torchrun"], results["rdzv run"]
        print(
            f"torchrun / rdzv run: hello {t['hello'] / d['hello']:.2f}x, "
            f"fail+restart {t['restart'] / d['restart']:.2f}x"
        )


if __name__ == "__main__":
    main()
