"""torch's expiration timers under ``rdzv run``: the agent's side of torch's file-timer protocol.

Theory of operation. torchrun's agent serves torch's
``torch.distributed.elastic.timer.FileTimerClient`` when its environment has
``TORCHELASTIC_ENABLE_FILE_TIMER=1``: it creates a named pipe at
``TORCHELASTIC_TIMER_FILE`` (a fresh temporary path when that is unset)
and gives its path to the workers in the same variable. A worker wraps a
step in ``expires(after=S, scope=...)``: the client opens the pipe without
blocking, writes one JSON line of at most ``PIPE_BUF`` bytes (``{"version":
1, "pid": P, "scope_id": ..., "expiration_time": T, "signal": N}``; ``T`` is
wall-clock, ``time.time() + S``, and a negative ``T`` releases the scope's
timer) and closes it. :class:`FileTimerServer` speaks the same protocol.

* The pipe is opened for reading without blocking and also once for
  writing by the agent itself, so that a client's non-blocking open always
  finds a reader and the reader never sees end-of-file. One background
  thread reads whole lines as they come (so a worker that acquires timers
  at a high rate never finds the pipe full, however long the agent's
  monitor interval), parses them and applies them to a
  :class:`TimerTable` under a lock; a malformed line is reported once and
  dropped.
* :class:`TimerTable` holds the decisions, on wall-clock times handed in
  (an injected clock in the tests): a timer per (pid, scope), bounded in
  number; :meth:`TimerTable.due` takes out the timers whose expiration
  time has passed, earliest first.
* Each monitor tick the agent calls :meth:`FileTimerServer.check`. A due
  timer of one of this attempt's workers (the worker's own pid or a
  process in its session) gets its pid the requested signal (torch's
  client asks SIGKILL), and the expiry is returned, to be reported as the
  worker's failure and to restart the group. torchrun's agent instead kills
  itself. A due timer whose signal is 0 or less is reported and dropped
  (torch leaves such a worker alone); one of a pid that is not a worker of
  the attempt (an earlier attempt's worker, another program) is dropped,
  with a line if the process still runs.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import select
import selectors
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rdzv.threads import start_thread

__all__ = [
    "ENABLE_VARIABLE",
    "FILE_VARIABLE",
    "MAX_TIMERS",
    "Expiry",
    "FileTimerServer",
    "TimerRequest",
    "TimerTable",
    "owner_of",
    "parse_request",
]

#: torchrun serves the timers when this variable is ``1`` in its environment.
ENABLE_VARIABLE = "TORCHELASTIC_ENABLE_FILE_TIMER"

#: The named pipe's path (chosen by the agent when unset), passed to the workers.
FILE_VARIABLE = "TORCHELASTIC_TIMER_FILE"

#: The most timers held at once; requests for more new timers are dropped.
MAX_TIMERS = 10_000

_READ_SIZE = 1 << 16

Clock = Callable[[], float]


@dataclass(frozen=True)
class TimerRequest:
    """One line of torch's protocol: acquire (or, with a negative time, release) a timer.

    Args:
        pid: The worker process that sent it.
        scope: The timer's scope (``scope_id``).
        expiration: Seconds since the epoch when it expires; negative: release.
        signum: The signal to send its pid when it expires (0 or less: none).
    """

    pid: int
    scope: str
    expiration: float
    signum: int

    @property
    def release(self) -> bool:
        """Whether the request releases the scope's timer."""
        return self.expiration < 0


def parse_request(line: bytes) -> TimerRequest:
    """Parse one request line of torch's ``FileTimerClient``.

    Raises:
        ValueError: Not a JSON object with an integer ``pid`` (positive),
            a string ``scope_id``, a number ``expiration_time`` and an
            integer ``signal``.
    """
    if len(line) > select.PIPE_BUF:
        raise ValueError(f"a request of {len(line)} bytes (over PIPE_BUF, {select.PIPE_BUF})")
    try:
        data = json.loads(line)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if not isinstance(data, dict):
        data = {}
    pid, scope = data.get("pid"), data.get("scope_id")
    expiration, signum = data.get("expiration_time"), data.get("signal")
    if not (
        isinstance(pid, int)
        and isinstance(signum, int)
        and not isinstance(pid, bool)
        and not isinstance(signum, bool)
        and pid > 0
        and isinstance(scope, str)
    ):
        raise ValueError("not an object with pid, scope_id and signal of the right types")
    number = float(expiration) if isinstance(expiration, int | float) else math.nan
    if isinstance(expiration, bool) or not math.isfinite(number):
        raise ValueError("expiration_time is not a finite number")
    return TimerRequest(pid, scope, number, signum)


@dataclass(frozen=True)
class Expiry:
    """A timer that expired.

    Args:
        pid: The process that acquired it.
        scope: Its scope.
        after: Seconds between the agent reading the request and the
            expiration time (the ``after`` of torch's ``expires``, as the
            agent saw it).
        signum: The signal requested for its pid.
    """

    pid: int
    scope: str
    after: float
    signum: int


class TimerTable:
    """The timers of one node's workers: which are held, which expired.

    Times are wall-clock seconds, as torch's clients write them.

    Args:
        limit: The most timers held at once.
    """

    def __init__(self, limit: int = MAX_TIMERS) -> None:
        self._limit = limit
        # (pid, scope) -> (request, wall-clock time it was read)
        self._timers: dict[tuple[int, str], tuple[TimerRequest, float]] = {}

    def __len__(self) -> int:
        return len(self._timers)

    def apply(self, request: TimerRequest, received: float) -> bool:
        """Acquire or release a timer; False when a new timer is refused (the table is full)."""
        key = (request.pid, request.scope)
        if request.release:
            self._timers.pop(key, None)
            return True
        if key not in self._timers and len(self._timers) >= self._limit:
            return False
        self._timers[key] = (request, received)
        return True

    def due(self, now: float) -> list[Expiry]:
        """Take out the timers expired at wall-clock ``now``, earliest expiration first."""
        expired = sorted(
            (item for item in self._timers.items() if item[1][0].expiration <= now),
            key=lambda item: item[1][0].expiration,
        )
        found = []
        for key, (request, received) in expired:
            del self._timers[key]
            after = max(request.expiration - received, 0.0)
            found.append(Expiry(request.pid, request.scope, after, request.signum))
        return found

    def clear(self) -> None:
        """Forget every timer."""
        self._timers.clear()


class FileTimerServer:
    """Serves torch's file timers on a named pipe (see the module's notes).

    Args:
        path: The named pipe to create (an existing file there is replaced).
        log: Receives one-line messages.
        clock: The wall clock expiration times are compared with.
    """

    def __init__(self, path: Path, log: Callable[[str], None], clock: Clock = time.time) -> None:
        self.path = path
        self._log = log
        self._clock = clock
        self._table = TimerTable()
        self._lock = threading.Lock()
        self._fds: list[int] = []
        self._wake: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None
        self._reported = False

    def open(self) -> None:
        """Create the pipe and start reading it.

        Raises:
            OSError: The pipe could not be created or opened.
        """
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISDIR(self.path.lstat().st_mode):
                self.path.unlink()
        os.mkfifo(self.path, 0o600)
        try:
            reader = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            self._fds.append(reader)
            self._fds.append(os.open(self.path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC))
            self._wake = os.pipe()
        except OSError:
            self.close()
            raise
        self._thread = start_thread(self._read, name="rdzv-file-timers", args=(reader,))

    def close(self) -> None:
        """Stop reading, close the pipe and remove it."""
        if self._wake is not None:
            os.write(self._wake[1], b"x")
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        for fd in self._fds + list(self._wake or ()):
            os.close(fd)
        self._fds.clear()
        self._wake = None
        with contextlib.suppress(OSError):
            if stat.S_ISFIFO(self.path.lstat().st_mode):
                self.path.unlink()

    def reset(self) -> None:
        """Forget every timer (a new attempt's workers start)."""
        with self._lock:
            self._table.clear()

    def check(self, owner: Callable[[int], int | None]) -> tuple[int, Expiry] | None:
        """Act on the timers due now; return the first one acted on, with its worker's rank.

        Args:
            owner: The global rank of the worker a pid belongs to, or None.
        """
        with self._lock:
            due = self._table.due(self._clock())
        for expiry in due:
            rank = owner(expiry.pid)
            if rank is None:
                if _exists(expiry.pid):
                    self._log(
                        f"expiration timer {expiry.scope!r} of pid {expiry.pid} expired; "
                        "ignored: that process is not a worker of this node"
                    )
                continue
            if expiry.signum <= 0:
                self._log(
                    f"rank {rank}'s expiration timer {expiry.scope!r} expired; it asked no "
                    f"signal ({expiry.signum}), so pid {expiry.pid} is left running"
                )
                continue
            with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
                os.kill(expiry.pid, expiry.signum)
            return rank, expiry
        return None

    def _read(self, reader: int) -> None:
        assert self._wake is not None
        wake = self._wake[0]
        pending = b""
        with selectors.DefaultSelector() as selector:
            selector.register(reader, selectors.EVENT_READ)
            selector.register(wake, selectors.EVENT_READ)
            while True:
                events = selector.select()
                if any(key.fd == wake for key, _ in events):
                    return
                try:
                    chunk = os.read(reader, _READ_SIZE)
                except BlockingIOError:
                    continue
                *lines, pending = (pending + chunk).split(b"\n")
                if len(pending) > select.PIPE_BUF:
                    self._report(f"a request of over {select.PIPE_BUF} bytes")
                    pending = b""
                self._take(lines)

    def _take(self, lines: list[bytes]) -> None:
        received = self._clock()
        for line in lines:
            if not line.strip():
                continue
            try:
                request = parse_request(line)
            except ValueError as exc:
                self._report(f"{line[:200]!r}: {exc}")
                continue
            with self._lock:
                kept = self._table.apply(request, received)
            if not kept:
                self._report(f"more than {MAX_TIMERS} timers held at once")

    def _report(self, problem: str) -> None:
        if not self._reported:
            self._reported = True
            self._log(
                f"ignored a bad expiration timer request on {self.path}: {problem} "
                "(later ones are ignored without a line)"
            )


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def owner_of(running: dict[int, int]) -> Callable[[int], int | None]:
    """Map a pid to the rank of the running worker it is, or whose session it is in.

    Args:
        running: Global rank -> pid of each running worker (every worker
            leads its own session).
    """
    ranks = {pid: rank for rank, pid in running.items()}

    def owner(pid: int) -> int | None:
        if pid in ranks:
            return ranks[pid]
        try:
            return ranks.get(os.getsid(pid))
        except OSError:
            return None

    return owner
