"""Confirming a sealed round: no member starts work beside a node that died in the queue.

Theory of operation
-------------------
A seal admits the nodes in the join queue. A node that died while it waited
there (alone before ``min_nodes`` came, or anywhere in a queue that filled
slowly) is admitted too: without a clock nobody can tell a node that
enqueued a moment ago from one that died a moment after enqueueing, and
rdzv reads no node's clock (torch compares the age of the node's last
heartbeat timestamp). Before this step the dead node was found only after
the round completed, by its ring predecessor one dead-node timeout later,
and every member restarted its workers.

So a member does not return from ``next_rendezvous`` on reading the seal.
It *confirms*: it adds one to the round's confirmation counter, and a member
whose add brings the counter to the world size writes the verdict key (more
than one may; they write the same thing). Every member waits for the verdict
in short slices and, between them, reads the state: once the round is gone
or a member of it was evicted (the ring predecessor of a dead member judges
and evicts it, as after any death), it joins the next round instead, within
the same call. A round with a dead member therefore completes for nobody,
and the verdict proves that every member was alive after the seal.

Cost: two requests per member (the add and the wait; a member that finds the
counter full also writes the verdict) and nothing while all are alive. The
counter and the verdict of a round are deleted with its join queue
(:func:`drop_confirmation`). A round of one needs no confirmation.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from rdzv.dynamic.state import RendezvousState
from rdzv.errors import StoreTimeoutError
from rdzv.store.base import Store

__all__ = [
    "CHECKS_PER_SECOND",
    "RoundConfirmation",
    "check_period",
    "drop_confirmation",
    "member_lost",
]

CHECKS_PER_SECOND = 2000.0
"""The most state checks per second the members of a round make while they wait to confirm."""


def check_period(world_size: int) -> float:
    """Return how often a member waiting to confirm checks that no member was lost.

    Every 0.25 s in a round of up to 500; in larger rounds less often, so
    the round stays within :data:`CHECKS_PER_SECOND`; at least once a second.

    Args:
        world_size: The number of participants.

    Returns:
        Seconds between checks.
    """
    return min(1.0, max(0.25, world_size / CHECKS_PER_SECOND))


@dataclass(frozen=True)
class RoundConfirmation:
    """The confirmation of one sealed round, in the run's store.

    Attributes:
        store: The store (the client of the thread that joins).
        prefix: The run's key prefix in the store.
        round_id: The sealed round.
        world_size: The number of its participants.
    """

    store: Store
    prefix: str
    round_id: int
    world_size: int

    @property
    def count_key(self) -> str:
        """The key counting the members that confirmed."""
        return _keys(self.prefix, self.round_id)[0]

    @property
    def verdict_key(self) -> str:
        """The key that exists once every member confirmed."""
        return _keys(self.prefix, self.round_id)[1]

    def confirm(self) -> None:
        """Count this member in; the member that completes the count writes the verdict."""
        if self.store.add(self.count_key, 1) >= self.world_size:
            self.store.set(self.verdict_key, b"confirmed")

    def wait(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for every member to confirm.

        Args:
            seconds: The longest wait.

        Returns:
            True once every member confirmed, False when the wait ran out.
        """
        try:
            self.store.wait([self.verdict_key], timedelta(seconds=seconds))
        except StoreTimeoutError:
            return False
        return True

    def confirmed(self) -> int:
        """Return how many members confirmed so far."""
        return self.store.add(self.count_key, 0)


def drop_confirmation(store: Store, prefix: str, round_id: int) -> None:
    """Delete the confirmation keys of ``round_id`` (a round nobody waits on).

    Args:
        store: The store.
        prefix: The run's key prefix.
        round_id: The round.
    """
    for key in _keys(prefix, round_id):
        store.delete_key(key)


def member_lost(sealed: RendezvousState, stored: RendezvousState | None) -> bool:
    """Tell whether a round awaiting confirmation lost a member, so it never completes.

    A close that came after the seal does not count: every live member still
    confirms (see :func:`rdzv.dynamic.machine.decide`).

    Args:
        sealed: The round as sealed.
        stored: The stored state now.

    Returns:
        True when the round is gone from the store or a member was evicted.
    """
    if stored is None or stored.round != sealed.round:
        return True
    return stored.live_count < len(sealed.participants)


def _keys(prefix: str, round_id: int) -> tuple[str, str]:
    base = f"{prefix}confirm/{round_id}/"
    return base + "count", base + "verdict"
