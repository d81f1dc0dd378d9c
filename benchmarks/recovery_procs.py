"""The processes of ``recovery_bench.py``'s runs, read from ``/proc``: trees, ends, leftovers.

Linux only. A process counts as ended once it is gone or a zombie (its
parent, or init after its parent died, has not reaped it yet: it runs no
more). :class:`EndWatch` samples a set of pids in a thread and keeps the
first moment each was seen ended, so "every old worker stopped" is a
harness observation that does not depend on what a launcher prints.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ProcInfo:
    """One process: parent, process group, session, state letter."""

    ppid: int
    pgid: int
    sid: int
    state: str


def proc_info(pid: int) -> ProcInfo | None:
    """Process ``pid``'s :class:`ProcInfo`, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text.rsplit(")", 1)[1].split()
    return ProcInfo(int(fields[1]), int(fields[2]), int(fields[3]), fields[0])


def running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    info = proc_info(pid)
    return info is not None and info.state != "Z"


def table() -> dict[int, ProcInfo]:
    """Every process of the machine."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            info = proc_info(int(entry.name))
            if info is not None:
                found[int(entry.name)] = info
    return found


def descendants(roots: Iterable[int]) -> set[int]:
    """The running processes below ``roots`` (children, their children, ...), roots excluded."""
    procs = table()
    children: dict[int, list[int]] = {}
    for pid, info in procs.items():
        children.setdefault(info.ppid, []).append(pid)
    found: set[int] = set()
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found and procs[child].state != "Z":
                found.add(child)
                todo.append(child)
    return found


def leftovers(marker: str, groups: Iterable[int]) -> set[int]:
    """Running processes whose command line holds ``marker`` or whose group or session is in ``groups``.

    The harness's own process is never one.
    """
    groups = set(groups)
    found = set()
    for pid, info in table().items():
        if pid == os.getpid() or info.state == "Z":
            continue
        if info.pgid in groups or info.sid in groups:
            found.add(pid)
            continue
        with contextlib.suppress(OSError):
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.add(pid)
    return found


def kill(pids: Iterable[int], signum: signal.Signals = signal.SIGKILL) -> None:
    """Send ``signum`` to each of ``pids`` that still exists."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def kill_groups(pgids: Iterable[int], signum: signal.Signals = signal.SIGKILL) -> None:
    """Send ``signum`` to each process group of ``pgids`` that still exists."""
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signum)


def listening(pid: int, port: int) -> bool:
    """Whether a TCP socket listens on ``port`` in ``pid``'s network namespace."""
    for name in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for row in Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]:
                fields = row.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    return True
    return False


class EndWatch:
    """Samples ``pids`` every ``every`` seconds in a thread; :attr:`ended` maps each to when it ended.

    ``stop`` ends the sampling; a pid still running then keeps None.
    """

    def __init__(self, pids: Iterable[int], every: float = 0.02) -> None:
        self.ended: dict[int, float | None] = dict.fromkeys(pids)
        self._every = every
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="end-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            waiting = [pid for pid, t in self.ended.items() if t is None]
            if not waiting:
                return
            now = time.time()
            for pid in waiting:
                if not running(pid):
                    self.ended[pid] = now
            self._done.wait(self._every)

    def stop(self) -> dict[int, float | None]:
        """Stop sampling; return :attr:`ended`."""
        self._done.set()
        self._thread.join()
        return dict(self.ended)
