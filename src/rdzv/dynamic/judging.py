"""Judging a node dead from its heartbeat marks, on the observer's own clock.

A mark is a counter (or :data:`~rdzv.backends.base.GONE_MARK`), never a
time: an observer notes when it last saw a node's mark change
(:class:`MarkWatch`) and judges the node dead once the mark stood still for
the dead-node bound of its own monotonic time (:func:`judge_marks`). Who
judges whom is the machine's (:mod:`rdzv.dynamic.machine`); a seal that
waits for members judges them in tiers (:class:`SealJudging`). Pure: no
I/O, no clock of its own.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from rdzv.backends.base import GONE_MARK
from rdzv.dynamic.machine import Limits, backup_delay

__all__ = ["GONE_GRACE", "MarkWatch", "SealJudging", "judge_interval", "judge_marks"]

GONE_GRACE = 1.0
"""Seconds a node's mark must say that its process died (:data:`GONE_MARK`)
before the node is judged dead: a living node whose connection to the store
was reset writes a fresh mark well within it (:mod:`rdzv.store.will`)."""


@dataclass(frozen=True)
class MarkWatch:
    """What an observer knows of one node's heartbeat mark.

    Attributes:
        mark: The mark it saw.
        since: The observer's monotonic time when it first saw that mark.
        credited: Seconds of the mark staying unchanged that count against
            the node (see :func:`judge_marks`).
        seen_at: The observer's time of its last reading; None: ``since``.
    """

    mark: bytes | None
    since: float
    credited: float = 0.0
    seen_at: float | None = None


def judge_marks(
    watches: Mapping[str, MarkWatch],
    marks: Mapping[str, bytes | None],
    now: float,
    dead_after: float,
    max_gap: float = math.inf,
) -> tuple[dict[str, MarkWatch], list[str]]:
    """Judge nodes dead or alive from their heartbeat marks, on the observer's clock.

    A node is dead when its mark has not changed for ``dead_after`` seconds
    of the observer's monotonic clock. Nobody's wall clock is involved, so
    skewed clocks neither kill a living node nor keep a dead one alive. A
    mark that says the node's process died (:data:`GONE_MARK`) needs only
    :data:`GONE_GRACE` of it (or ``dead_after``, if shorter): the grace in
    which a living node whose connection the server lost restores its mark.

    The judgement is fair to the judged: only time during which the observer
    itself could read marks counts. Between two readings at most ``max_gap``
    seconds are credited, so when the backend stalled (a paused store), or
    the observer's own calls failed or it was starved, the node is not
    charged for the time in which its beats could not land or be seen (the
    handler passes one heartbeat interval).

    Returns ``(watches, dead)``: the updated watches of the nodes still judged
    alive, and the nodes judged dead. Only the nodes of ``marks`` are judged.
    """
    updated: dict[str, MarkWatch] = {}
    dead: list[str] = []
    for node, mark in marks.items():
        seen = watches.get(node)
        if seen is None or seen.mark != mark:
            updated[node] = MarkWatch(mark, now, 0.0, now)
            continue
        last = seen.since if seen.seen_at is None else seen.seen_at
        credited = seen.credited + min(max(0.0, now - last), max_gap)
        if credited >= (min(dead_after, GONE_GRACE) if mark == GONE_MARK else dead_after):
            dead.append(node)
        else:
            updated[node] = MarkWatch(mark, seen.since, credited, now)
    return updated, dead


def judge_interval(interval: float, dead_after: float) -> float:
    """Return how often an observer reads heartbeat marks.

    A small fraction of the dead-node timeout, so a death is found late by
    at most that much; never more often than every 20 ms, never less often
    than once per heartbeat interval.
    """
    return min(interval, max(0.02, dead_after / 40))


@dataclass(frozen=True)
class SealJudging:
    """When a node waiting on a deferred seal judges the missing members.

    The seal waits for the live members of the last round to re-join. The
    leaders (the nodes whose join made the round sealable: queue positions
    ``min_nodes`` and ``max_nodes``) judge the missing ones often, or a round
    whose members all died would block the next one forever. Everyone else
    judges only once the seal stalled (the leaders may be dead too), in tiers
    like the backups (:func:`backup_delay`): the next position after two
    dead-node timeouts, the two after it one timeout later, the four after
    those one more, and so on, each once per heartbeat interval. Each judge
    reads the marks of every node it waits for, so all N nodes judging at
    once would cost O(N^2) reads.

    Attributes:
        blocked_since: When this node first waited on the deferred seal.
        next_at: When it may judge next.
    """

    blocked_since: float | None = None
    next_at: float = -math.inf

    def due(
        self, position: int | None, limits: Limits, now: float, interval: float
    ) -> tuple[bool, SealJudging]:
        """Tell whether to judge now, and return the schedule after it."""
        since = now if self.blocked_since is None else self.blocked_since
        leader = position in (limits.min_nodes, limits.seal_at)
        tier = limits.grace
        if position is not None:
            tier = min(
                backup_delay(position, limits.min_nodes, limits.grace),
                backup_delay(position, limits.seal_at, limits.grace),
            )
        stalled = now - since >= limits.grace + tier
        if not (leader or stalled) or now < self.next_at:
            return False, SealJudging(since, self.next_at)
        every = judge_interval(interval, limits.grace) if leader else interval
        return True, SealJudging(since, now + every)
