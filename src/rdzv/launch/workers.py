"""Starting, watching and stopping one node's worker processes.

Theory of operation: every worker runs in its own session (so its process
group id is its pid) with stdout and stderr on pipes and the agent's stdin
(as under torchrun, so ``breakpoint()`` in a worker can read the terminal).
One pump thread per pipe reads whole lines and writes them, prefixed with
``[rank N]:`` (or the worker's own prefix), to the agent's own stdout or
stderr under one lock, so lines of different workers never interleave and no
partial line is lost (a last line without a newline gets one). A worker's
``console`` streams decide which of its streams reach the agent's output
(torchrun's ``--redirects``, ``--tee`` and ``--local-ranks-filter``). With a
log directory each worker also gets one file per attempt holding its whole
unprefixed output, and lines matching the duplicate filters are copied,
prefixed, to ``filtered_stdout.log`` / ``filtered_stderr.log`` there.

A worker's error file (``TORCHELASTIC_ERROR_FILE``) is where torch's
``@record`` writes the exception that ended it; a failed worker's exit
carries that root cause.

Stopping sends a signal (SIGTERM unless told otherwise) to every worker's
process group, waits a grace period, then sends SIGKILL to the groups still
alive; the pump threads end when the pipes close and are joined. To show
where hung workers are stuck, the agent can instead freeze them all, abort
them with faulthandler on and keep what each writes on stderr from then on
(:meth:`WorkerGroup.abort_for_stacks`). On Linux
each worker also asks the kernel for SIGKILL when the agent dies
(``PR_SET_PDEATHSIG``, through a small program that execs the worker:
:mod:`rdzv.launch.deathsig`), so a SIGKILLed agent leaves no orphan workers.

Every worker process is started by :func:`start_process`; a group may be
given another way to start one (a warm spare that becomes the worker:
:mod:`rdzv.launch.warm`), which must start it the same way.
"""

from __future__ import annotations

import contextlib
import enum
import os
import re
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from rdzv.launch.deathsig import check_program, trampoline, wait_armed
from rdzv.launch.exits import WorkerExit, read_root_cause
from rdzv.threads import start_thread

__all__ = [
    "OutputSink",
    "StartProcess",
    "Std",
    "StdChoice",
    "WorkerGroup",
    "WorkerSpec",
    "agent_line",
    "signal_group",
    "start_process",
]


def agent_line(message: str, when: float | None = None) -> bytes:
    """Format one of the agent's own lines: local time, ``rdzv run:``, the message.

    ``when`` is seconds since the epoch (now when None); the line ends in a
    newline: ``2030-01-31 12:00:00.123 rdzv run: message``.
    """
    now = time.time() if when is None else when
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
    millis = int(now % 1 * 1000)
    return f"{stamp}.{millis:03d} rdzv run: {message}\n".encode()


class Std(enum.IntFlag):
    """A set of a worker's standard streams (torch's ``Std``)."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3


@dataclass(frozen=True)
class StdChoice:
    """Streams chosen per local rank, as torchrun's ``--redirects`` and ``--tee`` give them.

    Args:
        default: The streams of every local rank not in ``per_rank``.
        per_rank: Local rank -> its streams.
    """

    default: Std = Std.NONE
    per_rank: Mapping[int, Std] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> StdChoice:
        """Parse torchrun's format: ``N`` for every local rank, or ``R:N,R:N,...``.

        ``N`` is 0 (none), 1 (stdout), 2 (stderr) or 3 (both).

        Raises:
            ValueError: The text is neither form.
        """
        value = text.strip()
        if re.fullmatch(r"[0-3]", value):
            return cls(Std(int(value)))
        if not re.fullmatch(r"\d+:[0-3](,\d+:[0-3])*", value):
            raise ValueError(
                f"{text!r} is neither 0-3 nor LOCAL_RANK:0-3,... "
                "(0 none, 1 stdout, 2 stderr, 3 both)"
            )
        per_rank: dict[int, Std] = {}
        for item in value.split(","):
            rank, _, streams = item.partition(":")
            per_rank[int(rank)] = Std(int(streams))
        return cls(Std.NONE, per_rank)

    def of(self, local_rank: int) -> Std:
        """Return the streams chosen for ``local_rank``."""
        return self.per_rank.get(local_rank, self.default)

    def __bool__(self) -> bool:
        return bool(self.default) or any(self.per_rank.values())


@dataclass(frozen=True)
class WorkerSpec:
    """One worker process to start.

    Args:
        rank: The worker's global rank (used in the output prefix and log name).
        local_rank: Its rank on this node.
        argv: The command line.
        env: The complete environment.
        console: The streams copied to the agent's stdout and stderr.
        prefix: The prefix of its lines on the console and in the filtered
            files (``[rank N]: `` when None).
        error_file: Where torch's ``@record`` writes its root cause (the
            worker gets it as ``TORCHELASTIC_ERROR_FILE``), or None.
    """

    rank: int
    local_rank: int
    argv: Sequence[str]
    env: Mapping[str, str]
    console: Std = Std.ALL
    prefix: str | None = None
    error_file: Path | None = None


def start_process(
    argv: Sequence[str], env: Mapping[str, str], pass_fds: Sequence[int] = ()
) -> subprocess.Popen[bytes]:
    """Start one worker process as every worker starts (a warm spare too).

    stdout and stderr on pipes, the agent's stdin, a session of its own, and
    SIGKILL when the agent's thread that called this ends (``PR_SET_PDEATHSIG``,
    asked for by :func:`~rdzv.launch.deathsig.trampoline`, no Python between
    fork and exec: call it from the agent's main thread). ``pass_fds`` stay
    open in the child.

    Raises:
        OSError: The process could not be started (its program is missing).
    """
    check_program(argv, env)
    process = subprocess.Popen(
        [*trampoline(), *argv],
        env=dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        pass_fds=tuple(pass_fds),
    )
    wait_armed(process.pid)
    return process


#: How a worker group starts one worker's process (cold: :func:`start_process`).
StartProcess = Callable[[WorkerSpec], "subprocess.Popen[bytes]"]


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
        """Write one complete line (ending in a newline) atomically."""
        stream = self._stderr if to_stderr else self._stdout
        with self._lock:
            try:
                stream.write(line)
                stream.flush()
            except (OSError, ValueError):
                # The agent's own output is gone (closed pipe); the log file
                # still gets the line.
                pass


class _LockedFile:
    """A binary file written whole line by whole line from several threads."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[bytes] = path.open("wb")
        self._lock = threading.Lock()

    def write(self, line: bytes) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.write(line)
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


_CAPTURE_LIMIT = 1 << 20
_CAPTURE_JOIN = 2.0


class _Worker:
    def __init__(
        self, spec: WorkerSpec, process: subprocess.Popen[bytes], log_file: _LockedFile | None
    ) -> None:
        self.spec = spec
        self.process = process
        self.log_file = log_file
        self.pumps: list[threading.Thread] = []
        # Its stderr lines from some moment on (see WorkerGroup.abort_for_stacks).
        self.captured: list[bytes] | None = None
        self.captured_size = 0

    def capture(self, line: bytes) -> None:
        if self.captured is not None and self.captured_size < _CAPTURE_LIMIT:
            self.captured.append(line)
            self.captured_size += len(line)


@dataclass(frozen=True)
class _Filter:
    needles: tuple[bytes, ...]
    file: _LockedFile


class WorkerGroup:
    """The worker processes of one node for one attempt.

    Args:
        specs: The workers to start.
        sink: Where prefixed output goes.
        log_dir: A directory for one log file per worker (``rank_N.log``), or None.
        duplicate_stdout_filters: Copy every stdout line containing one of
            these strings, prefixed, to ``log_dir/filtered_stdout.log``.
        duplicate_stderr_filters: The same for stderr (``filtered_stderr.log``).
        start: Starts one worker's process (a new one by default; see
            :mod:`rdzv.launch.warm` for warm spares).

    Raises:
        ValueError: Duplicate filters without a log directory.
    """

    def __init__(
        self,
        specs: Sequence[WorkerSpec],
        sink: OutputSink,
        log_dir: Path | None = None,
        duplicate_stdout_filters: Sequence[str] = (),
        duplicate_stderr_filters: Sequence[str] = (),
        start: StartProcess | None = None,
    ) -> None:
        if log_dir is None and (duplicate_stdout_filters or duplicate_stderr_filters):
            raise ValueError("duplicate filters write filtered_*.log files: they need a log_dir")
        self._specs = list(specs)
        self._start = start or _start_cold
        self._sink = sink
        self._log_dir = log_dir
        self._needles = {
            False: tuple(n.encode() for n in duplicate_stdout_filters),
            True: tuple(n.encode() for n in duplicate_stderr_filters),
        }
        self._filters: dict[bool, _Filter] = {}
        self._workers: list[_Worker] = []

    def start(self) -> None:
        """Start every worker.

        Raises:
            OSError: A worker could not be started (the ones already started
                are stopped first).
        """
        try:
            if self._log_dir is not None:
                self._log_dir.mkdir(parents=True, exist_ok=True)
                for to_stderr, needles in self._needles.items():
                    if needles:
                        name = "filtered_stderr.log" if to_stderr else "filtered_stdout.log"
                        self._filters[to_stderr] = _Filter(
                            needles, _LockedFile(self._log_dir / name)
                        )
            for spec in self._specs:
                self._start_one(spec)
        except BaseException:
            self.stop(grace=0.0)
            raise

    def _start_one(self, spec: WorkerSpec) -> None:
        log_file: _LockedFile | None = None
        if self._log_dir is not None:
            log_file = _LockedFile(self._log_dir / f"rank_{spec.rank}.log")
        if spec.error_file is not None:
            # torch's @record refuses to overwrite an error file it did not write.
            spec.error_file.parent.mkdir(parents=True, exist_ok=True)
            spec.error_file.unlink(missing_ok=True)
        try:
            process = self._start(spec)
        except BaseException:
            if log_file is not None:
                log_file.close()
            raise
        worker = _Worker(spec, process, log_file)
        self._workers.append(worker)
        prefix = (f"[rank {spec.rank}]: " if spec.prefix is None else spec.prefix).encode()
        for stream, to_stderr in ((process.stdout, False), (process.stderr, True)):
            assert stream is not None
            worker.pumps.append(
                start_thread(
                    self._pump,
                    args=(worker, stream, prefix, to_stderr),
                    name=f"rdzv-output-rank{spec.rank}-{'err' if to_stderr else 'out'}",
                )
            )

    def _pump(self, worker: _Worker, stream: IO[bytes], prefix: bytes, to_stderr: bool) -> None:
        shown = bool(worker.spec.console & (Std.ERR if to_stderr else Std.OUT))
        duplicate = self._filters.get(to_stderr)
        with stream:
            for raw in iter(stream.readline, b""):
                line = raw if raw.endswith(b"\n") else raw + b"\n"
                if shown:
                    self._sink.write_line(prefix + line, to_stderr)
                if worker.log_file is not None:
                    worker.log_file.write(line)
                if to_stderr:
                    worker.capture(line)
                if duplicate is not None and any(n in line for n in duplicate.needles):
                    duplicate.file.write(prefix + line)

    def poll(self) -> list[WorkerExit] | None:
        """Check the workers without blocking.

        None while any worker runs and none failed; otherwise the exits of the
        workers that ended so far, failures first (lowest rank first among
        them). Empty failures and all zero codes mean success.
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
        error_file = worker.spec.error_file
        root_cause = None
        if code != 0 and error_file is not None:
            root_cause = read_root_cause(error_file)
        return WorkerExit(
            worker.spec.rank,
            worker.spec.local_rank,
            worker.process.pid,
            code,
            None if worker.log_file is None else worker.log_file.path,
            root_cause,
        )

    def stop(self, grace: float, signum: signal.Signals = signal.SIGTERM) -> None:
        """Stop every worker: ``signum`` to each process group, then SIGKILL after ``grace``.

        Also joins the output threads and closes the log files. Safe to call
        more than once. ``signum`` is the first signal (torchrun forwards the
        one the agent got), SIGKILL follows ``grace`` seconds later.
        """
        alive = [w for w in self._workers if w.process.poll() is None]
        for worker in alive:
            signal_group(worker.process.pid, signum)
        deadline = time.monotonic() + grace
        for worker in alive:
            remaining = deadline - time.monotonic()
            try:
                worker.process.wait(timeout=max(remaining, 0.0))
            except subprocess.TimeoutExpired:
                signal_group(worker.process.pid, signal.SIGKILL)
        for worker in alive:
            worker.process.wait()
        self.close()

    def running(self) -> dict[int, int]:
        """Return the pid of every running worker, by global rank."""
        return {w.spec.rank: w.process.pid for w in self._workers if w.process.poll() is None}

    def hung(self, rank: int, hang: str, signum: int, wait: float) -> WorkerExit:
        """Return the exit of the worker of ``rank``, judged hung and sent ``signum``.

        Waits up to ``wait`` seconds for it to end; ``returncode`` is
        ``-signum`` if it has not (stopping the group ends it).
        """
        worker = next(w for w in self._workers if w.spec.rank == rank)
        try:
            code = worker.process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            code = -signum
        log_path = None if worker.log_file is None else worker.log_file.path
        return WorkerExit(
            rank, worker.spec.local_rank, worker.process.pid, code, log_path, hang=hang
        )

    def abort_for_stacks(self, wait: float) -> dict[int, bytes]:
        """Have every running worker print its Python stacks, then kill every worker.

        The running workers are stopped (SIGSTOP), so that every stack is of
        the same moment; each gets SIGABRT with core dumps turned off (its
        ``RLIMIT_CORE`` set to 0), then SIGCONT. A Python worker with
        faulthandler on (``PYTHONFAULTHANDLER``) writes the stack of every
        thread to its stderr and dies, whatever its main thread is blocked
        in. Once every one ended, or after ``wait`` seconds, every worker's
        process group gets SIGKILL.

        Returns:
            Global rank -> what the worker wrote on stderr from the signal
            on (read until its pipe closed, or for a few seconds), for the
            workers that were running.
        """
        alive = [w for w in self._workers if w.process.poll() is None]
        for worker in alive:
            worker.captured = []
        for signum in (signal.SIGSTOP, signal.SIGABRT, signal.SIGCONT):
            for worker in alive:
                if signum == signal.SIGABRT:
                    _no_core_dump(worker.process.pid)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(worker.process.pid, signum)
        deadline = time.monotonic() + wait
        for worker in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.process.wait(timeout=max(deadline - time.monotonic(), 0.0))
        for worker in alive:
            signal_group(worker.process.pid, signal.SIGKILL)
        for worker in alive:
            worker.process.wait()
        deadline = time.monotonic() + _CAPTURE_JOIN
        for pump in (p for w in alive for p in w.pumps):
            pump.join(timeout=max(deadline - time.monotonic(), 0.0))
        return {w.spec.rank: b"".join(w.captured or ()) for w in alive}

    def send_signal(self, signum: signal.Signals) -> None:
        """Send ``signum`` to the process group of every running worker (nothing else)."""
        for worker in self._workers:
            if worker.process.poll() is None:
                signal_group(worker.process.pid, signum)

    def close(self) -> None:
        """Join the output threads and close the log files of ended workers."""
        for worker in self._workers:
            if worker.process.poll() is None:
                continue
            for pump in worker.pumps:
                # A grandchild may hold the pipe open; do not wait for it forever.
                pump.join(timeout=5.0)
            if worker.log_file is not None:
                worker.log_file.close()
        if all(w.process.poll() is not None for w in self._workers):
            for duplicate in self._filters.values():
                duplicate.file.close()


def _no_core_dump(pid: int) -> None:
    """Keep an aborted worker from writing a core file (Linux; elsewhere nothing)."""
    prlimit = getattr(resource, "prlimit", None)
    if prlimit is not None:
        with contextlib.suppress(OSError, ValueError):
            prlimit(pid, resource.RLIMIT_CORE, (0, 0))


def _start_cold(spec: WorkerSpec) -> subprocess.Popen[bytes]:
    return start_process(spec.argv, spec.env)


def signal_group(pgid: int, signum: signal.Signals) -> None:
    """Send ``signum`` to process group ``pgid``; one that is gone already is no error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)
