"""Hung workers under ``rdzv run``: the progress watchdog, and the one hook the agent polls.

Theory of operation. :class:`HangWatch` is what the agent sees: it sets up
an attempt's workers (:meth:`HangWatch.begin` returns the variables their
environment gets) and, each monitor tick, :meth:`HangWatch.check` returns
the exit of a worker it judged hung and ended, or None. It watches two
ways, each off unless asked:

* torch's expiration timers (``TORCHELASTIC_ENABLE_FILE_TIMER=1`` in the
  agent's environment, as under torchrun): :mod:`rdzv.launch.timers` serves
  torch's file-timer protocol; an expired timer's pid gets the signal it
  asked and the group restarts.
* the progress watchdog (``--hang-timeout S``): each worker finds in its
  environment a directory and a rate, and :func:`rdzv.progress` rewrites a
  counter in ``rank_<r>.progress`` there at most once per rate period
  (:func:`progress_every`: a tenth of S, at most a second). Every tick
  the agent reads each running worker's counter; :class:`ProgressJudge`
  notes, on the agent's monotonic clock, when it saw a counter change
  (the file's timestamps and the worker's clock are never read). A rank is
  judged only once its file exists (its first call); it is hung when no
  change was seen for ``S + period``: its last write may precede its last
  call by up to a period, so a hung verdict means at least S s without a
  call, and it comes at most S + period + a tick or two after the last one.

A hung rank's node then writes the Python stacks of every running worker
before any is killed: the workers run with ``PYTHONFAULTHANDLER`` set, are
frozen together (SIGSTOP), aborted with core dumps off (SIGABRT, then
SIGCONT), and what each writes on stderr from then on is kept
(:meth:`~rdzv.launch.workers.WorkerGroup.abort_for_stacks`): faulthandler
writes every thread's stack from its signal handler, without the GIL,
whether the main thread sleeps, waits on a lock or runs C code. Each is
written to ``rank_<r>.stacks`` in the attempt's log directory, or without
``--log-dir`` in a ``rdzv-stacks-*`` directory under the system's temporary
directory that is kept after the agent exits. Then every worker's process
group gets SIGKILL, and the agent restarts the group as after any failure
(a restart is counted).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

from rdzv.launch.exits import WorkerExit, signal_name
from rdzv.launch.timers import ENABLE_VARIABLE, FILE_VARIABLE, FileTimerServer, owner_of
from rdzv.launch.workers import WorkerGroup
from rdzv.worker import PROGRESS_DIR_VARIABLE, PROGRESS_EVERY_VARIABLE, progress_file

__all__ = ["DUMP_WAIT", "HangWatch", "ProgressJudge", "progress_every", "stack_report"]

#: Seconds the agent waits for the workers' stack dumps before it kills them.
DUMP_WAIT = 2.0

#: Seconds a worker sent an expired timer's signal has to end before its exit is reported.
_TIMER_EXIT_WAIT = 1.0

_MARK_SIZE = 64

Clock = Callable[[], float]


def progress_every(timeout: float) -> float:
    """Return the least seconds between two writes of a worker's progress file.

    A tenth of the hang timeout, at most one second.
    """
    return min(1.0, timeout / 10)


class ProgressJudge:
    """Tells which worker made no progress for the hang timeout, on the agent's clock.

    Args:
        timeout: The hang timeout (``--hang-timeout``), seconds.
        slack: The workers' write period: a verdict needs ``timeout +
            slack`` seconds without a change seen.
    """

    def __init__(self, timeout: float, slack: float) -> None:
        self.timeout = timeout
        self._limit = timeout + slack
        # rank -> (its last mark, when the agent first saw that mark)
        self._seen: dict[int, tuple[bytes, float]] = {}

    def reset(self) -> None:
        """Forget every rank (a new attempt's workers start)."""
        self._seen.clear()

    def observe(self, rank: int, mark: bytes, now: float) -> None:
        """Note ``rank``'s progress mark read at ``now``; empty: no progress call yet."""
        if not mark:
            return
        last = self._seen.get(rank)
        if last is None or last[0] != mark:
            self._seen[rank] = (mark, now)

    def hung(self, ranks: Iterable[int], now: float) -> int | None:
        """Return the rank among ``ranks`` silent longest past the limit, or None."""
        late = [
            (self._seen[rank][1], rank)
            for rank in ranks
            if rank in self._seen and now - self._seen[rank][1] >= self._limit
        ]
        return min(late)[1] if late else None


def stack_report(rank: int, pid: int, captured: bytes, header: str) -> str:
    """Return the text of one worker's stack file: ``header``, then its faulthandler dump.

    Without a dump in ``captured`` (not a Python process, faulthandler
    turned off, SIGABRT handled by the program) the text says so and holds
    what the worker wrote on stderr after the signal.
    """
    text = captured.decode(errors="replace")
    start = text.find("Fatal Python error")
    if start >= 0:
        return f"{header}\n\n{text[start:]}"
    note = (
        f"no Python stack was captured from rank {rank} (pid {pid}): it wrote no faulthandler "
        "dump on SIGABRT (not a Python process, faulthandler turned off, or SIGABRT handled "
        "by the program)"
    )
    after = f"\nwhat it wrote on stderr after the signal:\n{text}" if text else ""
    return f"{header}\n\n{note}\n{after}"


class HangWatch:
    """The agent's watch for hung workers: torch's expiration timers and the progress watchdog.

    Args:
        hang_timeout: Seconds without progress after which a rank is hung
            (``--hang-timeout``), or None for no progress watchdog.
        log_dir: The agent's log directory; the stack files go to its
            attempt directories. None: a kept temporary directory.
        environ: The environment the workers start from; torch's timers are
            served when it has ``TORCHELASTIC_ENABLE_FILE_TIMER=1``.
        log: Receives one-line messages.
        clock: The monotonic clock progress is judged on.
        wall: The wall clock timers' expiration times are compared with.
    """

    def __init__(
        self,
        hang_timeout: float | None,
        log_dir: Path | None,
        environ: Mapping[str, str],
        log: Callable[[str], None],
        clock: Clock = time.monotonic,
        wall: Clock = time.time,
    ) -> None:
        self._log_dir = log_dir
        self._environ = environ
        self._log = log
        self._clock = clock
        self._wall = wall
        self._timers_on = environ.get(ENABLE_VARIABLE) == "1"
        self._every = 0.0 if hang_timeout is None else progress_every(hang_timeout)
        self._judge = None if hang_timeout is None else ProgressJudge(hang_timeout, self._every)
        self._server: FileTimerServer | None = None
        self._private: Path | None = None
        self._kept: Path | None = None
        self._attempt_dir = Path()
        self._marks: dict[int, int] = {}

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """Serve torch's timers (when asked) for as long as the agent runs; clean up after."""
        if not (self._timers_on or self._judge is not None):
            yield
            return
        self._private = Path(tempfile.mkdtemp(prefix="rdzv-hang-"))
        try:
            if self._timers_on:
                self._open_timers(self._private)
            yield
        finally:
            self._close_marks()
            if self._server is not None:
                self._server.close()
                self._server = None
            shutil.rmtree(self._private, ignore_errors=True)
            self._private = None

    def _open_timers(self, private: Path) -> None:
        path = Path(self._environ.get(FILE_VARIABLE) or private / "timers.fifo")
        server = FileTimerServer(path, self._log, self._wall)
        try:
            server.open()
        except OSError as exc:
            self._log(
                f"cannot serve torch's expiration timers ({ENABLE_VARIABLE}=1) at {path}: "
                f"{exc.strerror or exc}; the workers' timers will fail"
            )
            return
        self._server = server

    def begin(self, attempt_dir: Path) -> dict[str, str]:
        """Start watching a new attempt; return what its workers' environment gets.

        Args:
            attempt_dir: The attempt's directory, relative (``<run id>/attempt_<k>``).
        """
        self._attempt_dir = attempt_dir
        self._close_marks()
        env: dict[str, str] = {}
        if self._server is not None:
            self._server.reset()
            env[FILE_VARIABLE] = str(self._server.path)
        if self._judge is not None and self._private is not None:
            self._judge.reset()
            directory = self._private / attempt_dir
            directory.mkdir(parents=True, exist_ok=True)
            env[PROGRESS_DIR_VARIABLE] = str(directory)
            env[PROGRESS_EVERY_VARIABLE] = repr(self._every)
            if not self._environ.get("PYTHONFAULTHANDLER"):
                env["PYTHONFAULTHANDLER"] = "1"
        return env

    def check(self, workers: WorkerGroup) -> WorkerExit | None:
        """Look for a hung worker; end it and return its exit, or None (each monitor tick)."""
        if self._server is None and self._judge is None:
            return None
        running = workers.running()
        if self._server is not None:
            found = self._server.check(owner_of(running))
            if found is not None:
                rank, expiry = found
                self._log(
                    f"rank {rank}'s expiration timer {expiry.scope!r} expired: sent "
                    f"{signal_name(expiry.signum) or f'signal {expiry.signum}'} to pid {expiry.pid}"
                )
                hang = f": expiration timer {expiry.scope!r} expired after {expiry.after:.2g} s"
                return workers.hung(rank, hang, expiry.signum, _TIMER_EXIT_WAIT)
        if self._judge is None or self._private is None:
            return None
        now = self._clock()
        for rank in running:
            self._judge.observe(rank, self._read_mark(rank), now)
        hung = self._judge.hung(running, now)
        return None if hung is None else self._abort(hung, running, workers)

    def _read_mark(self, rank: int) -> bytes:
        fd = self._marks.get(rank)
        if fd is None:
            assert self._private is not None
            path = progress_file(self._private / self._attempt_dir, rank)
            try:
                fd = self._marks[rank] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return b""
        try:
            return os.pread(fd, _MARK_SIZE, 0)
        except OSError:
            return b""

    def _close_marks(self) -> None:
        for fd in self._marks.values():
            os.close(fd)
        self._marks.clear()

    def _abort(self, rank: int, running: dict[int, int], workers: WorkerGroup) -> WorkerExit:
        assert self._judge is not None
        timeout = self._judge.timeout
        directory = self._stacks_dir()
        self._log(
            f"rank {rank} made no progress for {timeout:g} s: writing the stacks of this "
            f"node's {len(running)} worker(s) to {directory}, then killing them"
        )
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self._wall()))
        captured = workers.abort_for_stacks(DUMP_WAIT)
        paths: dict[int, Path] = {}
        try:
            directory.mkdir(parents=True, exist_ok=True)
            for each, text in captured.items():
                pid = running.get(each, 0)
                header = (
                    f"rdzv run: Python stacks of rank {each} (pid {pid}) at {when}, after rank "
                    f"{rank} made no progress for {timeout:g} s"
                )
                path = directory / f"rank_{each}.stacks"
                path.write_text(stack_report(each, pid, text, header))
                paths[each] = path
        except OSError as exc:
            self._log(f"could not write the stacks to {directory}: {exc.strerror or exc}")
        where = f"; stacks in {paths[rank]}" if rank in paths else "; no stack file"
        others = sorted(path.name for each, path in paths.items() if each != rank)
        if others:
            where += f" (and {', '.join(others)} beside it)"
        return workers.hung(rank, f" (no progress for {timeout:g} s){where}", signal.SIGABRT, 0.0)

    def _stacks_dir(self) -> Path:
        if self._log_dir is not None:
            return self._log_dir / self._attempt_dir
        if self._kept is None:
            try:
                self._kept = Path(tempfile.mkdtemp(prefix="rdzv-stacks-"))
            except OSError:
                return Path(tempfile.gettempdir(), "rdzv-stacks") / self._attempt_dir
        return self._kept / self._attempt_dir
