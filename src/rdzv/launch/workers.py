"""Starting, watching and stopping one node's worker processes.

Theory of operation: every worker runs in its own session (so its process
group id is its pid) with stdout and stderr on pipes. One pump thread per
pipe reads whole lines and writes them, prefixed with ``[rank N]:``, to the
agent's own stdout or stderr under one lock, so lines of different workers
never interleave and no partial line is lost (a last line without a newline
gets one). With a log directory each worker also gets one file per attempt
holding its unprefixed output. Stopping sends SIGTERM to every worker's
process group, waits a grace period, then sends SIGKILL to the groups still
alive; the pump threads end when the pipes close and are joined. On Linux
each worker also asks the kernel for SIGKILL when the agent dies
(``PR_SET_PDEATHSIG``), so a SIGKILLed agent leaves no orphan workers.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

__all__ = [
    "OutputSink",
    "WorkerExit",
    "WorkerGroup",
    "WorkerSpec",
    "agent_line",
    "describe_returncode",
]


def agent_line(message: str, when: float | None = None) -> bytes:
    """Format one of the agent's own lines: local time, ``rdzv run:``, the message.

    Args:
        message: The text, without a newline.
        when: Seconds since the epoch (now when None).

    Returns:
        The line as bytes, ending in a newline:
        ``2030-01-31 12:00:00.123 rdzv run: message``.
    """
    now = time.time() if when is None else when
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
    millis = int(now % 1 * 1000)
    return f"{stamp}.{millis:03d} rdzv run: {message}\n".encode()


@dataclass(frozen=True)
class WorkerSpec:
    """One worker process to start.

    Args:
        rank: The worker's global rank (used in the output prefix and log name).
        local_rank: Its rank on this node.
        argv: The command line.
        env: The complete environment.
    """

    rank: int
    local_rank: int
    argv: Sequence[str]
    env: Mapping[str, str]


def describe_returncode(returncode: int) -> str:
    """Describe how a process ended.

    Args:
        returncode: ``Popen.returncode``; negative means killed by a signal.

    Returns:
        ``"exited with code N"`` or ``"was killed by signal SIGX (N)"``.
    """
    if returncode >= 0:
        return f"exited with code {returncode}"
    signum = -returncode
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = "an unknown signal"
    return f"was killed by signal {name} ({signum})"


@dataclass(frozen=True)
class WorkerExit:
    """How one worker ended.

    Args:
        rank: The worker's global rank.
        local_rank: Its rank on this node.
        pid: Its process id.
        returncode: ``Popen.returncode`` (negative: killed by that signal).
        log_path: Its log file, when there is one.
    """

    rank: int
    local_rank: int
    pid: int
    returncode: int
    log_path: Path | None

    def describe(self) -> str:
        """Return a one-line account of the exit, naming the rank and its log."""
        text = f"worker rank {self.rank} (local rank {self.local_rank}, pid {self.pid}) "
        text += describe_returncode(self.returncode)
        if self.log_path is not None:
            text += f"; log: {self.log_path}"
        return text


_PR_SET_PDEATHSIG = 1


def _death_signal_setter() -> Callable[[], None] | None:
    """Return a ``preexec_fn`` that makes the child die with its parent, if the OS can."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc: Any = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None

    def set_death_signal() -> None:
        # Runs in the child between fork and exec: no allocation-heavy work here.
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))

    return set_death_signal


_SET_DEATH_SIGNAL = _death_signal_setter()


class OutputSink:
    """Where workers' prefixed output lines go: the agent's stdout and stderr.

    Args:
        stdout: Binary stream for workers' stdout lines.
        stderr: Binary stream for workers' stderr lines.
    """

    def __init__(self, stdout: IO[bytes] | None = None, stderr: IO[bytes] | None = None) -> None:
        self._stdout = stdout if stdout is not None else sys.stdout.buffer
        self._stderr = stderr if stderr is not None else sys.stderr.buffer
        self._lock = threading.Lock()

    def write_line(self, line: bytes, to_stderr: bool) -> None:
        """Write one complete line (ending in a newline) atomically.

        Args:
            line: The line.
            to_stderr: Write to the stderr stream instead of stdout.
        """
        stream = self._stderr if to_stderr else self._stdout
        with self._lock:
            try:
                stream.write(line)
                stream.flush()
            except (OSError, ValueError):
                # The agent's own output is gone (closed pipe); the log file
                # still gets the line.
                pass


class _Worker:
    def __init__(
        self,
        spec: WorkerSpec,
        process: subprocess.Popen[bytes],
        log_file: IO[bytes] | None,
        log_path: Path | None,
    ) -> None:
        self.spec = spec
        self.process = process
        self.log_file = log_file
        self.log_path = log_path
        self.log_lock = threading.Lock()
        self.pumps: list[threading.Thread] = []


class WorkerGroup:
    """The worker processes of one node for one attempt.

    Args:
        specs: The workers to start.
        sink: Where prefixed output goes.
        log_dir: A directory for one log file per worker (``rank_N.log``), or None.
    """

    def __init__(
        self, specs: Sequence[WorkerSpec], sink: OutputSink, log_dir: Path | None = None
    ) -> None:
        self._specs = list(specs)
        self._sink = sink
        self._log_dir = log_dir
        self._workers: list[_Worker] = []

    def start(self) -> None:
        """Start every worker.

        Raises:
            OSError: A worker could not be started (the ones already started
                are stopped first).
        """
        if self._log_dir is not None:
            self._log_dir.mkdir(parents=True, exist_ok=True)
        try:
            for spec in self._specs:
                self._start_one(spec)
        except BaseException:
            self.stop(grace=0.0)
            raise

    def _start_one(self, spec: WorkerSpec) -> None:
        log_path: Path | None = None
        log_file: IO[bytes] | None = None
        if self._log_dir is not None:
            log_path = self._log_dir / f"rank_{spec.rank}.log"
            log_file = log_path.open("wb")
        try:
            process = subprocess.Popen(
                list(spec.argv),
                env=dict(spec.env),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                preexec_fn=_SET_DEATH_SIGNAL,  # noqa: PLW1509 - only calls prctl
            )
        except BaseException:
            if log_file is not None:
                log_file.close()
            raise
        worker = _Worker(spec, process, log_file, log_path)
        self._workers.append(worker)
        prefix = f"[rank {spec.rank}]: ".encode()
        for stream, to_stderr in ((process.stdout, False), (process.stderr, True)):
            assert stream is not None
            pump = threading.Thread(
                target=self._pump,
                args=(worker, stream, prefix, to_stderr),
                name=f"rdzv-output-rank{spec.rank}-{'err' if to_stderr else 'out'}",
                daemon=True,
            )
            worker.pumps.append(pump)
            pump.start()

    def _pump(self, worker: _Worker, stream: IO[bytes], prefix: bytes, to_stderr: bool) -> None:
        with stream:
            for raw in iter(stream.readline, b""):
                line = raw if raw.endswith(b"\n") else raw + b"\n"
                self._sink.write_line(prefix + line, to_stderr)
                if worker.log_file is not None:
                    with worker.log_lock:
                        if not worker.log_file.closed:
                            worker.log_file.write(line)
                            worker.log_file.flush()

    def poll(self) -> list[WorkerExit] | None:
        """Check the workers without blocking.

        Returns:
            None while any worker runs and none failed; otherwise the exits
            of the workers that ended so far, failures first (lowest rank
            first among them). Empty failures and all zero codes mean success.
        """
        exits: list[WorkerExit] = []
        running = False
        for worker in self._workers:
            code = worker.process.poll()
            if code is None:
                running = True
                continue
            exits.append(self._exit_of(worker, code))
        failed = [e for e in exits if e.returncode != 0]
        if running and not failed:
            return None
        failed.sort(key=lambda e: e.rank)
        return failed + [e for e in exits if e.returncode == 0]

    def _exit_of(self, worker: _Worker, code: int) -> WorkerExit:
        return WorkerExit(
            worker.spec.rank, worker.spec.local_rank, worker.process.pid, code, worker.log_path
        )

    def stop(self, grace: float) -> None:
        """Stop every worker: SIGTERM to each process group, then SIGKILL after ``grace``.

        Also joins the output threads and closes the log files. Safe to call
        more than once.

        Args:
            grace: Seconds to wait after SIGTERM before SIGKILL.
        """
        alive = [w for w in self._workers if w.process.poll() is None]
        for worker in alive:
            _signal_group(worker.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for worker in alive:
            remaining = deadline - time.monotonic()
            try:
                worker.process.wait(timeout=max(remaining, 0.0))
            except subprocess.TimeoutExpired:
                _signal_group(worker.process.pid, signal.SIGKILL)
        for worker in alive:
            worker.process.wait()
        self.close()

    def close(self) -> None:
        """Join the output threads and close the log files of ended workers."""
        for worker in self._workers:
            if worker.process.poll() is None:
                continue
            for pump in worker.pumps:
                # A grandchild may hold the pipe open; do not wait for it forever.
                pump.join(timeout=5.0)
            if worker.log_file is not None and not worker.log_file.closed:
                with worker.log_lock:
                    worker.log_file.close()


def _signal_group(pgid: int, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)
