"""What a worker started by ``rdzv run`` can call: :func:`progress`.

``rdzv.progress()`` is one line in a training loop that tells the agent the
worker is still making progress. Under ``rdzv run --hang-timeout S`` the
agent names a directory (``RDZV_PROGRESS_DIR``) and a rate
(``RDZV_PROGRESS_EVERY``, seconds) in the worker's environment; a call then
rewrites a counter at the start of the worker's file there
(``rank_<RANK>.progress``), at most once per rate period: one clock read
per call, one ``pwrite`` per period. The agent watches the file's content
change on its own monotonic clock; the worker's clock and the file's
timestamps play no part in the verdict.

Anywhere else (no ``RDZV_PROGRESS_DIR``: another launcher, ``rdzv run``
without ``--hang-timeout``, a plain ``python train.py``) a call does nothing
after the first, which reads the environment once. This module imports only
the standard library and nothing else of rdzv, so ``import rdzv`` and the
first call stay cheap.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

__all__ = ["PROGRESS_DIR_VARIABLE", "PROGRESS_EVERY_VARIABLE", "ProgressBeacon", "progress"]

#: The directory of the workers' progress files (set by ``rdzv run --hang-timeout``).
PROGRESS_DIR_VARIABLE = "RDZV_PROGRESS_DIR"

#: The least number of seconds between two writes of a worker's progress file.
PROGRESS_EVERY_VARIABLE = "RDZV_PROGRESS_EVERY"


def progress_file(directory: Path | str, rank: int) -> Path:
    """Return the progress file of the worker of global rank ``rank`` in ``directory``."""
    return Path(directory, f"rank_{rank}.progress")


class ProgressBeacon:
    """Marks a worker's progress in a file, at most once every ``every`` seconds.

    Args:
        path: The file (created on the first write).
        every: The least number of seconds between two writes.
        clock: The monotonic clock that spaces the writes.
    """

    __slots__ = ("_clock", "_count", "_every", "_fd", "_next", "_path", "_warned")

    def __init__(
        self, path: Path, every: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._path = path
        self._every = every
        self._clock = clock
        self._next = -float("inf")
        self._count = 0
        self._fd: int | None = None
        self._warned = False

    def mark(self) -> None:
        """Record progress: rewrite the counter unless the last write is under ``every`` s old.

        A file that cannot be written gets one warning on stderr; later
        calls try again.
        """
        now = self._clock()
        if now < self._next:
            return
        self._next = now + self._every
        self._count += 1
        try:
            if self._fd is None:
                self._fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
            os.pwrite(self._fd, b"%020d\n" % self._count, 0)
        except OSError as exc:
            self._warn(f"cannot write the progress file {self._path}: {exc.strerror or exc}")

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            print(f"rdzv.progress(): {message}", file=sys.stderr, flush=True)


def _noop() -> None:
    return None


def _first_call() -> None:
    global _mark
    _mark = _noop
    beacon = beacon_from_environment(os.environ)
    if beacon is not None:
        _mark = beacon.mark
        beacon.mark()


def beacon_from_environment(environ: Mapping[str, str]) -> ProgressBeacon | None:
    """Return the beacon ``rdzv run`` asked for in ``environ``, or None when it asked none.

    A malformed request (no integer ``RANK``, a rate that is not a positive
    number) gets one warning on stderr and None.
    """
    directory = environ.get(PROGRESS_DIR_VARIABLE)
    if not directory:
        return None
    rank = environ.get("RANK", "")
    every_text = environ.get(PROGRESS_EVERY_VARIABLE, "")
    try:
        every = float(every_text)
        number = int(rank)
    except ValueError:
        every = number = -1
    if not every > 0 or number < 0:
        print(
            f"rdzv.progress(): ignored: {PROGRESS_DIR_VARIABLE} is set but RANK={rank!r} or "
            f"{PROGRESS_EVERY_VARIABLE}={every_text!r} is not valid",
            file=sys.stderr,
            flush=True,
        )
        return None
    return ProgressBeacon(progress_file(directory, number), every)


_mark: Callable[[], None] = _first_call


def progress() -> None:
    """Tell ``rdzv run --hang-timeout`` that this worker is making progress.

    Call it once per training step (or more often): it costs a clock read
    per call and a small file write at most once per second. A worker
    that has called it once and then does not call it for the hang timeout
    is judged hung: the agent writes the stacks of every worker of the node
    and restarts the group. A worker is not judged before its first call.
    Outside ``rdzv run --hang-timeout`` it does nothing.
    """
    _mark()
