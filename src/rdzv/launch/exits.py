"""How a worker ended: its exit, in one line, with the root cause torch's ``@record`` left.

A worker's error file (``TORCHELASTIC_ERROR_FILE``) is where torch's
``@record`` writes the exception that ended it; :func:`read_root_cause`
reads it (bounded: a file over a megabyte, or one that does not decode, is
no root cause), and :class:`WorkerExit` carries it into the line that
reports the failure.
"""

from __future__ import annotations

import json
import re
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["WorkerExit", "describe_returncode", "read_root_cause", "signal_name"]


def signal_name(signum: int) -> str | None:
    """Return the name of signal ``signum`` (``SIGKILL``), or None when no signal has it."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return None


def describe_returncode(returncode: int) -> str:
    """Describe how a process ended: ``exited with code N`` or ``was killed by signal SIGX (N)``."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    signum = -returncode
    name = signal_name(signum) or "an unknown signal"
    return f"was killed by signal {name} ({signum})"


_ERROR_FILE_LIMIT = 1 << 20
_ROOT_CAUSE_LIMIT = 300
_FRAME = re.compile(r'File "([^"\n]+)", line (\d+), in (\S+)')


def read_root_cause(path: Path) -> str | None:
    """Read the root cause torch's ``@record`` wrote into a worker's error file.

    The file is torch's JSON (``{"message": {"message": "ValueError: ...",
    "extraInfo": {"py_callstack": ...}}}``, or a plain ``message`` string).
    Anything missing, too large or malformed gives None; this never raises.
    The answer is one line, ``"ValueError: bad input (at train.py:12 in
    main)"``, with control characters escaped, of a few hundred characters
    at most.
    """
    try:
        with path.open("rb") as file:
            raw = file.read(_ERROR_FILE_LIMIT + 1)
        if len(raw) > _ERROR_FILE_LIMIT:
            return None
        data = json.loads(raw)
    except (OSError, ValueError):
        return None
    message: Any = data.get("message") if isinstance(data, dict) else None
    stack: Any = None
    if isinstance(message, dict):
        extra = message.get("extraInfo")
        stack = extra.get("py_callstack") if isinstance(extra, dict) else None
        message = message.get("message")
    if not isinstance(message, str) or not message.strip():
        return None
    text = message.strip().splitlines()[0]
    frames = _FRAME.findall(stack) if isinstance(stack, str) else []
    if frames:
        filename, line, function = frames[-1]
        text += f" (at {filename}:{line} in {function})"
    text = text.encode("unicode_escape").decode("ascii")
    if len(text) > _ROOT_CAUSE_LIMIT:
        text = text[: _ROOT_CAUSE_LIMIT - 3] + "..."
    return text


@dataclass(frozen=True)
class WorkerExit:
    """How one worker ended.

    Args:
        rank: The worker's global rank.
        local_rank: Its rank on this node.
        pid: Its process id.
        returncode: ``Popen.returncode`` (negative: killed by that signal).
        log_path: Its log file, when there is one.
        root_cause: The exception torch's ``@record`` recorded, when it failed
            and left one.
        hang: Why the agent judged the worker hung and ended it (what
            follows ``rank N hung``), or None; its ``returncode`` is then
            the signal the agent sent (negative) if it had not ended yet.
    """

    rank: int
    local_rank: int
    pid: int
    returncode: int
    log_path: Path | None
    root_cause: str | None = None
    hang: str | None = None

    def describe(self) -> str:
        """Return a one-line account of the exit: rank, code (or hang), root cause, log."""
        if self.hang is not None:
            text = (
                f"rank {self.rank} hung{self.hang}; pid {self.pid} (local rank {self.local_rank})"
            )
        else:
            text = f"worker rank {self.rank} (local rank {self.local_rank}, pid {self.pid}) "
            text += describe_returncode(self.returncode)
        if self.root_cause is not None:
            text += f": {self.root_cause}"
        if self.log_path is not None:
            text += f"; log: {self.log_path}"
        return text
