"""See elasticity on one machine: agents join, one dies, the group re-forms.

    python examples/elastic_demo.py

It starts a store server (``rdzv serve``) and two ``rdzv run`` agents on
localhost (``--nnodes 2:3``, one worker each), adds a third agent, kills one
with SIGKILL, and finally lets the workers finish. It prints the timeline of
what the agents report: every round they form, with its size. Nothing is
restarted as a failure: growing and shrinking re-form the group.

Under ``rdzv run`` (with ``--worker DIR``) this file is the worker: it
prints its rank now and then and exits once ``DIR/finish`` exists.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROUND = re.compile(r"node (\d+)/(\d+) starting workers .* of (\d+)")


def worker(directory: Path) -> int:
    """Run as a worker until the demo says finish.

    Args:
        directory: The demo's scratch directory.

    Returns:
        0.
    """
    rank, world = os.environ["RANK"], os.environ["WORLD_SIZE"]
    deadline = time.monotonic() + 120
    step = 0
    while not (directory / "finish").exists() and time.monotonic() < deadline:
        if step % 20 == 0:
            print(f"working as rank {rank} of {world}", flush=True)
        step += 1
        time.sleep(0.05)
    return 0


class Demo:
    """Runs the agents and collects their timeline."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.started = time.monotonic()
        self.lock = threading.Condition()
        self.sizes: dict[str, int] = {}
        self.timeline: list[str] = []
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.readers: list[threading.Thread] = []
        self.endpoint = ""

    def note(self, who: str, text: str) -> None:
        """Add one line to the timeline and print it."""
        line = f"[{time.monotonic() - self.started:5.1f} s] {who}: {text}"
        with self.lock:
            self.timeline.append(line)
            self.lock.notify_all()
            print(line, flush=True)

    def serve(self) -> subprocess.Popen[str]:
        """Start the store server and remember its endpoint."""
        server = subprocess.Popen(
            [sys.executable, "-m", "rdzv.cli", "serve", "--host", "127.0.0.1", "--port", "0"],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert server.stdout is not None
        self.endpoint = server.stdout.readline().split()[-1]
        self.note("store", f"listening on {self.endpoint}")
        return server

    def agent(self, name: str) -> None:
        """Start one ``rdzv run`` agent."""
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rdzv.cli",
                "run",
                "--nnodes=2:3",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={self.endpoint}",
                "--rdzv-id=demo",
                (
                    "--rdzv-conf=is_host=false,last_call_timeout=1,"
                    "keep_alive_interval=0.5,keep_alive_max_attempt=3"
                ),
                "--local-addr=127.0.0.1",
                __file__,
                "--worker",
                str(self.directory),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.procs[name] = proc
        reader = threading.Thread(target=self._read, args=(name, proc), daemon=True)
        self.readers.append(reader)
        reader.start()
        self.note(name, f"started (pid {proc.pid})")

    def _read(self, name: str, proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            # Agent lines are "<date> <time> rdzv run: message"; the demo has its own clock.
            text = line.strip().partition("rdzv run: ")[2] or line.strip()
            match = ROUND.search(text)
            if match:
                with self.lock:
                    self.sizes[name] = int(match.group(2))
                self.note(name, f"in a round of {match.group(2)} nodes as node {match.group(1)}")
            elif text:
                self.note(name, text)

    def wait_for_round(self, names: list[str], size: int, timeout: float = 60) -> None:
        """Wait until every named agent reports a round of ``size`` nodes."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while not all(self.sizes.get(n) == size for n in names):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise SystemExit(f"timed out waiting for a round of {size} nodes")
                self.lock.wait(remaining)

    def kill(self, name: str) -> None:
        """SIGKILL one agent (its worker dies with it)."""
        self.procs[name].kill()
        self.procs[name].wait()
        self.sizes.pop(name, None)
        self.note(name, "killed with SIGKILL")

    def finish(self) -> int:
        """Let the workers finish and wait for the agents.

        Returns:
            0 when every surviving agent exited 0.
        """
        (self.directory / "finish").write_text("")
        self.note("demo", "told the workers to finish")
        codes = []
        for name, proc in self.procs.items():
            if proc.returncode is None:
                codes.append(proc.wait(timeout=60))
                self.note(name, f"exited with {proc.returncode}")
        for reader in self.readers:
            reader.join(timeout=10)
        return 0 if all(code == 0 for code in codes) else 1

    def stop_all(self) -> None:
        """Kill whatever still runs."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def main() -> int:
    """Run the demo, or a worker under ``--worker``.

    Returns:
        The exit status.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(Path(args.worker))
    with tempfile.TemporaryDirectory() as tmp:
        demo = Demo(Path(tmp))
        server = demo.serve()
        try:
            demo.agent("agent A")
            demo.agent("agent B")
            demo.wait_for_round(["agent A", "agent B"], 2)
            demo.agent("agent C")
            demo.wait_for_round(["agent A", "agent B", "agent C"], 3)
            demo.kill("agent B")
            demo.wait_for_round(["agent A", "agent C"], 2)
            status = demo.finish()
        finally:
            demo.stop_all()
            server.terminate()
            server.wait()
    print("\nrounds seen: " + " -> ".join(_sizes_in_order(demo.timeline)))
    return status


def _sizes_in_order(timeline: list[str]) -> list[str]:
    sizes: list[str] = []
    for line in timeline:
        match = re.search(r"in a round of (\d+) nodes", line)
        if match and (not sizes or sizes[-1] != match.group(1)):
            sizes.append(match.group(1))
    return sizes


if __name__ == "__main__":
    sys.exit(main())
