"""Running ``rdzv run`` agents as real processes in tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tests.procs import ROOT, Children, subprocess_env

WORKER = str(Path(__file__).with_name("worker.py"))
HELLO = str(ROOT / "examples" / "hello.py")
ALLREDUCE = str(ROOT / "examples" / "allreduce.py")


class Agents(Children):
    """Starts ``rdzv run`` processes and stops every one of them at the end."""

    def start(
        self,
        args: Sequence[str],
        stderr_path: Path | None = None,
        env: dict[str, str] | None = None,
        stdin: int | None = None,
        command: Sequence[str] = ("-m", "rdzv.cli", "run"),
    ) -> subprocess.Popen[str]:
        """Start ``rdzv run`` (or another ``command``); stderr to ``stderr_path`` when given."""
        with contextlib.ExitStack() as stack:
            err = stack.enter_context(stderr_path.open("w")) if stderr_path else subprocess.PIPE
            return self.popen(
                [sys.executable, *command, *args],
                cwd=ROOT,
                env=subprocess_env() if env is None else env,
                stdin=stdin,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )


@contextlib.contextmanager
def agents() -> Iterator[Agents]:
    group = Agents()
    try:
        yield group
    finally:
        group.stop()


def finish(proc: subprocess.Popen[str], timeout: float = 60) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def alive(pid: int) -> bool:
    """Tell whether a process runs (a zombie waiting to be reaped does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def kill_pids(pids: Sequence[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


CONF = "is_host=false,last_call_timeout=0.5,keep_alive_interval=0.5,keep_alive_max_attempt=4"


def envs(outdir: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(outdir.glob("env-*.json"))]


def with_world(outdir: Path, world: int) -> list[dict[str, Any]]:
    return [e for e in envs(outdir) if e["WORLD_SIZE"] == str(world)]


def c10d_args(endpoint: str, nnodes: str, run_id: str) -> list[str]:
    return [
        f"--nnodes={nnodes}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        f"--rdzv-conf={CONF}",
        "--local-addr=127.0.0.1",
        "--monitor-interval=0.05",
    ]
