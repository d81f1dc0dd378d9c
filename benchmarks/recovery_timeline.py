"""What ``recovery_bench.py`` reads from a run's logs: events, and the phases of one recovery.

Every agent's stdout and stderr go to one log file, which also receives its
workers' output (``rdzv run`` copies it with a ``[rank N]: `` prefix,
torchrun lets the workers inherit the agent's streams). Three kinds of lines
matter:

* a worker's event, ``@recovery <time.time()> <event> rank= world= restart=
  pid= step=`` (``recovery_worker.py``), anywhere in the line;
* an ``rdzv run`` agent line, ``2026-12-07 18:03:33.073 rdzv run: ...``
  (local time to the millisecond; ``--log-level INFO`` adds the rendezvous
  events as ``INFO rdzv.dynamic: rdzv {"action": "complete", ...}``);
* a torchrun agent line, glog style, ``I1207 18:03:33.073000 4242
  .../api.py:553] ...`` (local time, no year; ``LOGLEVEL=INFO``).

:func:`phases` turns them, with the fault's time and the moments the
harness saw the old workers' processes end, into the seconds from the fault
to each step of the recovery. A step a launcher does not show is None
(printed as ``-``), never a guess.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

WORKER_LINE = re.compile(
    r"@recovery (?P<t>\d+\.\d+) (?P<event>\w+) rank=(?P<rank>\d+) world=(?P<world>\d+) "
    r"restart=(?P<restart>\d+) pid=(?P<pid>\d+) step=(?P<step>\d+)"
)
RDZV_LINE = re.compile(
    r"^(?P<stamp>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\.(?P<ms>\d{3}) rdzv run: (?P<text>.*)"
)
TORCH_LINE = re.compile(
    r"^[IWEF](?P<stamp>\d{4} \d\d:\d\d:\d\d)\.(?P<frac>\d+) +\d+ \S+\] (?P<text>.*)"
)
ROUND_COMPLETE = re.compile(r'"action": "complete"|Rendezvous complete for workers')
"""A line saying this agent's round completed (rdzv's event, torchrun's agent)."""

SLACK = 0.001
"""Agent stamps are cut to the millisecond: a line of the fault's millisecond counts as after it."""


@dataclass(frozen=True)
class WorkerEvent:
    """One ``@recovery`` line of a worker."""

    t: float
    event: str
    rank: int
    world: int
    restart: int
    pid: int
    step: int


@dataclass(frozen=True)
class AgentLine:
    """One line an agent printed itself: when, which agent, what it says."""

    t: float
    agent: int
    text: str


def parse_line(line: str, agent: int, year: int) -> WorkerEvent | AgentLine | None:
    """The event or agent line ``line`` of agent ``agent``'s log holds, else None.

    ``year`` completes torchrun's stamps, which have none.
    """
    found = WORKER_LINE.search(line)
    if found:
        g = found.groupdict()
        return WorkerEvent(
            float(g["t"]),
            g["event"],
            int(g["rank"]),
            int(g["world"]),
            int(g["restart"]),
            int(g["pid"]),
            int(g["step"]),
        )
    rdzv = RDZV_LINE.match(line)
    if rdzv:
        t = time.mktime(time.strptime(rdzv["stamp"], "%Y-%m-%d %H:%M:%S"))
        return AgentLine(t + int(rdzv["ms"]) / 1000, agent, rdzv["text"])
    torch = TORCH_LINE.match(line)
    if torch:
        t = time.mktime(time.strptime(f"{year}{torch['stamp']}", "%Y%m%d %H:%M:%S"))
        return AgentLine(t + float("0." + torch["frac"]), agent, torch["text"])
    return None


class LogTail:
    """Reads one agent's log as it grows, keeping what :func:`parse_line` found."""

    def __init__(self, path: Path, agent: int) -> None:
        self.path = path
        self.agent = agent
        self.events: list[WorkerEvent] = []
        self.lines: list[AgentLine] = []
        self._offset = 0
        self._partial = b""
        self._year = time.localtime().tm_year

    def read(self) -> None:
        """Parse the complete lines written since the last call."""
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        self._offset += len(chunk)
        *whole, self._partial = (self._partial + chunk).split(b"\n")
        for raw in whole:
            found = parse_line(raw.decode(errors="replace"), self.agent, self._year)
            if isinstance(found, WorkerEvent):
                self.events.append(found)
            elif isinstance(found, AgentLine):
                self.lines.append(found)


@dataclass(frozen=True)
class Recovery:
    """Seconds from the fault to each step of one recovery (None: not seen).

    ``knows``: the first line an agent other than the faulty one printed
    after the fault; ``stopped``: every worker process that ran at the fault
    had ended (seen by the harness); ``formed``: the last agent of the new
    round printed that it completed (in a run that did not train again: the
    last such line seen); ``started``: every worker of the group
    that trained again had begun (its first statement); ``ready``: they all
    had their process group; ``step``: they all had finished a step.
    ``world`` is the size the group trained at, ``restarts`` the restart
    count its workers were given (the largest).
    """

    knows: float | None
    stopped: float | None
    formed: float | None
    started: float | None
    ready: float | None
    step: float | None
    world: int | None
    restarts: int | None


def first_training(
    events: Iterable[WorkerEvent], fault: float, old_pids: set[int], world: int | None
) -> tuple[float, dict[int, int]] | None:
    """When a group of new workers had all finished a step after ``fault``, and their pids by rank.

    A group is every rank ``0..W-1`` of one world size ``W`` (``world`` when
    given, any otherwise: the earliest to train) by processes that did not
    run at the fault. None when no such group trained.
    """
    firsts: dict[int, dict[int, WorkerEvent]] = {}
    for e in events:
        if e.event != "step" or e.t < fault or e.pid in old_pids:
            continue
        if world is not None and e.world != world:
            continue
        by_rank = firsts.setdefault(e.world, {})
        if e.rank not in by_rank or e.t < by_rank[e.rank].t:
            by_rank[e.rank] = e
    best: tuple[float, dict[int, int]] | None = None
    for size, by_rank in firsts.items():
        if set(by_rank) != set(range(size)):
            continue
        when = max(e.t for e in by_rank.values())
        if best is None or when < best[0]:
            best = (when, {rank: e.pid for rank, e in by_rank.items()})
    return best


def phases(
    fault: float,
    events: Iterable[WorkerEvent],
    lines: Iterable[AgentLine],
    old_pids: set[int],
    ended: Mapping[int, float | None],
    observers: set[int],
    world: int | None = None,
) -> Recovery:
    """The :class:`Recovery` of one run.

    Args:
        fault: When the fault was made (``time.time()``).
        events: Every worker event of the run.
        lines: Every agent line of the run.
        old_pids: The workers that ran at the fault.
        ended: The workers that must stop for the recovery, each with the
            time the harness saw its process end (None: it did not).
        observers: The agents whose first line after the fault counts as
            "an agent knows" (not the one killed, not a joining one).
        world: The size the group must train at again (None: any).
    """
    events = list(events)
    lines = sorted(lines, key=lambda x: x.t)
    after = [x for x in lines if x.t >= fault - SLACK]
    knows = next((x.t - fault for x in after if x.agent in observers), None)
    ends = list(ended.values())
    stopped = None if not ends or None in ends else max(e for e in ends if e is not None) - fault
    complete = [x.t for x in after if ROUND_COMPLETE.search(x.text)]
    trained = first_training(events, fault, old_pids, world)
    if trained is None:
        formed = max(complete) - fault if complete else None
        return Recovery(knows, stopped, formed, None, None, None, None, None)
    when, group = trained
    pids = set(group.values())
    mine = [e for e in events if e.pid in pids]
    starts = [e.t for e in mine if e.event == "start"]
    readies = [e.t for e in mine if e.event == "ready"]
    started = max(starts) if len(starts) == len(pids) else None
    ready = max(readies) - fault if len(readies) == len(pids) else None
    complete = [t for t in complete if started is None or t <= started + SLACK]
    return Recovery(
        knows=knows,
        stopped=stopped,
        formed=max(complete) - fault if complete else None,
        started=None if started is None else started - fault,
        ready=ready,
        step=when - fault,
        world=len(group),
        restarts=max(e.restart for e in mine),
    )
