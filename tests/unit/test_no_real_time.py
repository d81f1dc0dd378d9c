"""Decisions run on the injected clock: real time is read only where ``REAL_TIME_ALLOWED`` says why.

The core, the engines and the store clients wait, sleep and give up on the
caller's :class:`rdzv.retry.Clock` (``current_clock()``, or a clock they
were given), so a test on a fake clock sleeps nowhere and a loaded machine
cannot change a decision. A module that calls ``time.monotonic``,
``time.sleep``, ``time.time`` or ``time.perf_counter`` (or their ``_ns``
forms), by ``time.x``, by a ``from time import x`` or as a default
argument, fails ``test_real_time_is_read_only_where_allowed`` until it is
put on the clock or named below with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

REAL_TIME = frozenset(
    f"{name}{suffix}"
    for name in ("monotonic", "sleep", "time", "perf_counter")
    for suffix in ("", "_ns")
    if (name, suffix) != ("sleep", "_ns")
)

# module -> why it may read real time.
REAL_TIME_ALLOWED: dict[str, str] = {
    "rdzv.retry": "the real clock itself (Clock, REAL_TIME)",
    "rdzv.testing.clock": "the fake clocks' guard against a test that never moves them is real seconds",
    "rdzv.testing.store_conformance": (
        "checks a store of any kind, which has no clock: a write from a thread after a real delay, "
        "and a real bound on how long a get may hang"
    ),
    "rdzv.store.memory": (
        "the in-process store's waits block on a Condition, whose timeout is real seconds"
    ),
    "rdzv.store._connection": (
        "the store server's own bookkeeping (idle and blocked connections) in its process"
    ),
    "rdzv.store.server": "the store server's admission and idle sweeps, in its own process",
    "rdzv.store.admission": "the server's slots: an unused connection's age, in real time",
    "rdzv.store.throttle": "real time is the default of its injectable clock",
    "rdzv.worker": "the worker's heartbeat file: real time is the default of its injectable clock",
    "rdzv.status": (
        "real time is the default of its injectable clock and sleep; the wall clock dates records"
    ),
    "rdzv.torchrun.server_child": "a server child lingers for its clients in real time, then exits",
    "rdzv.launch.agent": (
        "supervises worker processes: its monitor interval, their grace and a round's timing are real"
    ),
    "rdzv.launch.warm": "waits for a warm spare process to start, in real time",
    "rdzv.launch.workers": "waits for worker processes to exit and their output pumps to drain",
    "rdzv.launch.watchdog": (
        "real time is the default of its injectable clocks; torch's timer files hold wall-clock times"
    ),
    "rdzv.launch.timers": "torch's timer protocol: expiry is a wall-clock time",
    "rdzv.launch.failures": "error files are dated by the wall clock (torch's format)",
    "rdzv.launch.deathsig": "waits, a few milliseconds, for setpriv to exec the worker",
    "rdzv.launch.health": (
        "an exclusion's end is a wall-clock time, read by the node's later agents and by people"
    ),
    "rdzv.launch.progress": "real time is the default of its injectable clock",
    "rdzv.launch.run": "a run's record is dated by the wall clock",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def real_time_reads(source: str) -> list[str]:
    """Return ``line: name`` for every real-time function ``source`` names."""
    tree = ast.parse(source)
    modules = {"time"}  # what ``time`` is imported as
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name == "time"}
        elif isinstance(node, ast.ImportFrom) and node.module == "time":
            found += [f"{node.lineno}: {a.name}" for a in node.names if a.name in REAL_TIME]
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and node.attr in REAL_TIME
        ):
            found.append(f"{node.lineno}: time.{node.attr}")
    return sorted(found)


def _reads_by_module() -> dict[str, list[str]]:
    reads = {_module_name(p): real_time_reads(p.read_text()) for p in SRC.rglob("*.py")}
    return {module: found for module, found in reads.items() if found}


def test_real_time_is_read_only_where_allowed() -> None:
    unexpected = {m: r for m, r in _reads_by_module().items() if m not in REAL_TIME_ALLOWED}
    assert unexpected == {}, "put these on the caller's clock, or allow them with a reason"


def test_every_allowed_module_still_reads_real_time() -> None:
    # An allowance outlives its reason otherwise: drop the module once it is on the clock.
    assert sorted(set(REAL_TIME_ALLOWED) - set(_reads_by_module())) == []


def test_every_form_of_a_real_time_read_is_found() -> None:
    source = (
        "import time\n"
        "import time as t\n"
        "from time import perf_counter\n"
        "def f(clock=time.monotonic):\n"
        "    t.sleep(1)\n"
        "    return time.time_ns()\n"
    )
    assert real_time_reads(source) == [
        "3: perf_counter",
        "4: time.monotonic",
        "5: time.sleep",
        "6: time.time_ns",
    ]
    assert real_time_reads("import time\nx = time.process_time()\ny = time.strftime('%H')\n") == []
