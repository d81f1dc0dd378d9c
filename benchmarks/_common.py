"""What every benchmark prints about the machine it ran on.

A figure means little without the load it was measured under: each
benchmark prints :func:`stamp` before its first measurement and after its
last, so a table pasted into the docs carries the load average beside it.
"""

from __future__ import annotations

import os
import time


def load() -> str:
    """Return the load averages, the core count and the running/total threads."""
    with open("/proc/loadavg") as f:
        avg = f.read().split()
    return f"loadavg {' '.join(avg[:3])} on {os.cpu_count()} cores ({avg[3]} running/threads)"


def stamp(when: str) -> None:
    """Print ``when``, the time of day and :func:`load` as one line."""
    print(f"{when}: {time.strftime('%H:%M:%S')} {load()}", flush=True)
