"""What the benchmarks share: the checkout on ``sys.path``, the test helpers, and :func:`stamp`.

Importing this module puts the checkout's ``src`` and root first on
``sys.path``, so a benchmark runs this tree's rdzv and can use the helpers
it shares with the tests (``tests/procs.py``: child environments, free
ports, bounded polling; ``tests/engines/servers.py``: private etcd and
redis-server), re-exported here.

A figure means little without the load it was measured under: each
benchmark prints :func:`stamp` before its first measurement and after its
last, so a table pasted into the docs carries the load average beside it.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

from tests.procs import (  # noqa: E402 - after the path
    NotReachedError,
    free_port,
    read_markers,
    subprocess_env,
    wait_until,
)

__all__ = [
    "ROOT",
    "NotReachedError",
    "free_port",
    "load",
    "read_markers",
    "stamp",
    "subprocess_env",
    "wait_until",
]


def load() -> str:
    """Return the load averages, the core count and the running/total threads."""
    with open("/proc/loadavg") as f:
        avg = f.read().split()
    return f"loadavg {' '.join(avg[:3])} on {os.cpu_count()} cores ({avg[3]} running/threads)"


def stamp(when: str) -> None:
    """Print ``when``, the time of day and :func:`load` as one line."""
    print(f"{when}: {time.strftime('%H:%M:%S')} {load()}", flush=True)
