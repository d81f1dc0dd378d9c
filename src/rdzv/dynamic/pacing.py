"""How long the driver's waits last and how often it reads: pure functions of the round's size.

Theory of operation
-------------------
One store host serves every node of a run, so each periodic read is
paced by the size of the group that makes it: the group's reads per
second stay under a budget (``*_PER_SECOND``) whatever its size, and a
small group is never slower than the fixed floor of each function. The
price is always the same: a change is seen late by at most one period.
The join (:mod:`rdzv.dynamic.join`) asks these functions how long each of
its waits lasts; the machine (:mod:`rdzv.dynamic.machine`) decides what it
waits for.
"""

from __future__ import annotations

__all__ = [
    "QUEUE_POLLS_PER_SECOND",
    "QUEUE_WAIT_CAP",
    "RING_READS_PER_SECOND",
    "SEAT_LAG",
    "WAITING_POLLS_PER_SECOND",
    "queue_wait",
    "ring_judge_period",
    "seat_wait",
    "state_wait",
    "state_wait_cap",
    "waiting_poll_gap",
]

RING_READS_PER_SECOND = 2000.0
"""The most mark readings per second a whole ring makes (one store host serves them all)."""

QUEUE_POLLS_PER_SECOND = 1000.0
"""The most queue-length readings per second the nodes waiting for a seal make together.

Each reading is two requests or three (the queue's length, the next wait,
sometimes the head's summary), so this budget bounds the polling share of
a formation's requests while the queue fills."""

WAITING_POLLS_PER_SECOND = 2000.0
"""The most backend reads per second the members of a round make together for ``num_nodes_waiting``."""

SEAT_LAG = 3.0
"""Seconds a node that finds its round sealed waits for its seat before reading the state.

A seal stores the members' seats right after its compare-and-set; a node
that looks in between finds the round sealed and its seat not yet there.
It reads the whole state only if the seat has not come by then (the
sealer died in between, or the seal left this node out: a spare then
learns it a few seconds later, and waits for the next round anyway). The
lag must exceed the time a starved sealer takes from its compare-and-set
to its seats, or every member of a large round reads the whole state at
once; it is not cut at :func:`state_wait_cap`, only at the join deadline."""

QUEUE_WAIT_CAP = 0.05
"""Seconds a deferred seal waits on the queue before it reads the state again.

A seal deferred for a missing member waits for it on the queue, which
cannot watch the state too; the eviction that unblocks it (by the missing
member's ring predecessor) is seen at the next read, so a recovery takes
the dead-node bound plus at most this. Only the few nodes whose seal is
deferred poll this often."""


def waiting_poll_gap(world_size: int) -> float:
    """Return how long a member serves its last ``num_nodes_waiting`` answer before reading again.

    An agent asks every monitor interval (0.1 s for ``rdzv run`` and
    torchrun), which, answered by a read each time, is ``10 N`` reads a
    second on one store host, forever. The answer is served for
    ``world_size / WAITING_POLLS_PER_SECOND`` seconds, so the round stays
    within :data:`WAITING_POLLS_PER_SECOND` (a round of up to 200 members
    asking every 0.1 s is not held back; torch serves its state for 1 s at
    any size); a waiting node or a lost member is then seen late by at most
    that much.

    Args:
        world_size: The number of participants of the round.

    Returns:
        Seconds.
    """
    return world_size / WAITING_POLLS_PER_SECOND


def state_wait_cap(queue_length: int) -> float:
    """Return the longest one wait for the state lasts before a node reads the queue again.

    A node waiting for a seal wakes at once for a change of the state and
    at its own deadlines (last call, backup, join timeout); in between it
    re-reads the queue's length, whose growth moves its backup deadline.
    The wait lasts a second, longer in queues over 1,000 nodes, so that
    they stay within :data:`QUEUE_POLLS_PER_SECOND` together; a backup then
    notices the queue grow late by at most that wait, which only delays a
    backup seal, and a node watching its seat notices a close, or a seal
    that left it out, as late.

    Args:
        queue_length: The length of the round's queue as last read.

    Returns:
        Seconds.
    """
    return max(1.0, queue_length / QUEUE_POLLS_PER_SECOND)


def state_wait(remaining: float, queue_length: int, stretch: float) -> float:
    """Return how long a joining node waits for the state: :func:`state_wait_cap`, stretched.

    ``stretch`` (1 to 1.5, drawn per wait) keeps nodes that joined together
    from reading together, so their readings do not all fall just before
    the seal.

    Args:
        remaining: Seconds until the machine's next deadline.
        queue_length: The length of the round's queue as last read.
        stretch: The random stretch of this wait.

    Returns:
        Seconds.
    """
    return min(remaining, state_wait_cap(queue_length) * stretch)


def queue_wait(remaining: float) -> float:
    """Return how long a deferred seal waits on the queue (:data:`QUEUE_WAIT_CAP` at most)."""
    return min(remaining, QUEUE_WAIT_CAP)


def seat_wait(join_left: float) -> float:
    """Return how long a node that found its round sealed waits for its seat (:data:`SEAT_LAG`)."""
    return min(join_left, SEAT_LAG)


def ring_judge_period(judge_every: float, interval: float, world_size: int) -> float:
    """Return how often a member reads its ring successor's mark in a round of ``world_size``.

    Every member reads once per period, so a ring of N members makes
    ``N / period`` reads a second, forever. The period grows with N so the
    ring stays within :data:`RING_READS_PER_SECOND`, never beyond one
    heartbeat interval: a death is then found late by at most that period
    (``judge_every`` for up to a few hundred nodes).

    Args:
        judge_every: The period for a small ring (:func:`~rdzv.dynamic.machine.judge_interval`).
        interval: The heartbeat interval, in seconds.
        world_size: The number of participants of the round.

    Returns:
        Seconds between readings.
    """
    return max(judge_every, min(interval, world_size / RING_READS_PER_SECOND))
