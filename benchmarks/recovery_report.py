"""The output of ``recovery_bench.py``: a line per run, then the two tables.

The first table gives, per fault and launcher, the minimum, median and
maximum over the runs of the seconds from the fault to every rank's first
step after it (a run that did not train again is ``never (> T s)`` or ``job
failed``, sorted last), the median's ratio to the base launcher's, the
restart counts the new workers were given, the surviving agents' exit
statuses, the orphans and the median load average at the fault. The second
gives each moment's median (see ``recovery_timeline.Recovery``).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from recovery_timeline import Recovery


@dataclass
class Result:
    """One run: its recovery (None when the run did not happen), exits, orphans, load."""

    fault: str
    launcher: str
    rep: int
    recovery: Recovery | None = None
    outcome: str = ""
    """``recovered``, ``timeout`` (not within --timeout), ``failed`` (too few agents left)."""
    note: str = ""
    exits: list[str] = field(default_factory=list)
    orphans: int = 0
    load: float = math.nan


def seconds(value: float | None) -> str:
    """Seconds to two decimals, ``-`` for a moment not seen."""
    return "-" if value is None else f"{value:.2f}"


def describe(result: Result) -> str:
    """One line for a finished run: each moment, the world, restarts, exits, orphans, load."""
    r = result.recovery
    head = f"rep {result.rep} {result.fault} / {result.launcher}:"
    if r is None:
        return f"{head} {result.note}"
    parts = ", ".join(
        f"{name} {seconds(getattr(r, name))}"
        for name in ("knows", "stopped", "formed", "started", "ready", "step")
    )
    return (
        f"{head} {parts}; world {r.world}, restarts {r.restarts}, exits {','.join(result.exits)}, "
        f"orphans {result.orphans}, load {result.load:.2f}"
    )


def first_step(result: Result, timeout: float) -> tuple[float, str]:
    """A run's seconds to its first step, and how to print them (never and failed sort last)."""
    r = result.recovery
    if result.outcome == "recovered" and r is not None and r.step is not None:
        return r.step, f"{r.step:.2f} s"
    if result.outcome == "failed":
        return math.inf, "job failed"
    return math.inf, f"never (> {timeout:g} s)"


def report(results: list[Result], title: str, timeout: float, base: str) -> None:
    """Print the two tables of ``results`` under ``title``; ratios are to the launcher ``base``."""
    print()
    print(title)
    print()
    print(
        f"| fault | launcher | recovered | min | median | max | / {base} | restarts "
        "| exits | orphans | load |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---|---|---:|---:|")
    groups: dict[tuple[str, str], list[Result]] = {}
    for r in results:
        groups.setdefault((r.fault, r.launcher), []).append(r)
    medians: dict[str, float] = {}
    for (fault, launcher), runs in groups.items():
        done = [r for r in runs if r.recovery is not None]
        if not done:
            note = runs[0].note or "-"
            print(f"| {fault} | {launcher} | {note} | - | - | - | - | - | - | - | - |")
            continue
        firsts = sorted(first_step(r, timeout) for r in done)
        middle = firsts[(len(firsts) - 1) // 2 : len(firsts) // 2 + 1]
        median = statistics.mean(value for value, _ in middle)
        median_text = middle[-1][1] if math.isinf(median) else f"{median:.2f} s"
        if launcher == base:
            medians[fault] = median
        ref = medians.get(fault)
        finite = ref is not None and not math.isinf(ref) and not math.isinf(median)
        ratio = f"{median / ref:.2f}x" if finite and ref else "-"
        restarts = sorted(
            {
                str(r.recovery.restarts)
                for r in done
                if r.recovery and r.recovery.restarts is not None
            }
        )
        exits = sorted({",".join(r.exits) for r in done})
        load = statistics.median(r.load for r in done)
        recovered = sum(1 for r in done if r.outcome == "recovered")
        print(
            f"| {fault} | {launcher} | {recovered}/{len(runs)} | {firsts[0][1]} | {median_text} "
            f"| {firsts[-1][1]} | {ratio} | {' '.join(restarts) or '-'} | {' '.join(exits) or '-'} "
            f"| {sum(r.orphans for r in done)} | {load:.2f} |"
        )
    print()
    print(
        "recovered: runs that trained again / runs (a run whose job did not start counts, "
        "without figures: see its line above); exits: the surviving agents' statuses, "
        "* where the harness had to SIGTERM the agent"
    )
    print()
    print("median seconds from the fault (over the runs where the moment was seen)")
    print()
    print(
        "| fault | launcher | agent knows | workers stopped | round formed | workers started "
        "| process group ready | first step |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for (fault, launcher), runs in groups.items():
        seen_runs = [r.recovery for r in runs if r.recovery is not None]
        if not seen_runs:
            continue
        cells = []
        for name in ("knows", "stopped", "formed", "started", "ready", "step"):
            seen = [getattr(r, name) for r in seen_runs if getattr(r, name) is not None]
            cells.append(seconds(statistics.median(seen)) if seen else "-")
        print(f"| {fault} | {launcher} | {' | '.join(cells)} |")
