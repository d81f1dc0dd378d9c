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
It *confirms*: it appends its node key to the round's confirmation queue (a
second queue of the engine's join-queue kind,
:meth:`~rdzv.backends.base.JoinQueueBackend.confirmation_queue`: one
non-conflicting write, like a join, which wakes no other waiter), and a
member whose position reaches the world size reads the queue and, when the
distinct nodes in it are every participant (an append retried after a lost
reply can count a member twice), writes the round's verdict. Every member
waits for the verdict or a write of the state, whichever comes first
(:class:`~rdzv.backends.base.VerdictBackend`: the engine's own, or
:class:`~rdzv.backends.kv.StoreVerdict` in the handler's store, which looks
at the state's token between slices of :func:`check_period`), and reads the
state only after such a write. Once its first slice has passed (and the
ring judges), the next wait runs to the join deadline, since nothing but
those two needs a look. Once the round is gone or a member of it was
evicted (the ring predecessor of a dead member judges and evicts it, as
after any death; a member's ring judging starts at the verdict, or at its
first slice that passes without it), it joins the next round instead,
within the same call. A round with a dead member therefore completes for
nobody, and the verdict proves that every member was alive after the seal.

Cost: two requests per member (the append and the wait; the last one also
reads the queue and writes the verdict) and nothing while all are alive.
The queue and the verdict of a round are deleted with its join queue.
A round of one needs no confirmation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rdzv.backends.base import JoinQueueBackend, Token, VerdictBackend
from rdzv.dynamic.state import RendezvousState
from rdzv.retry import REAL_TIME, Clock

__all__ = [
    "CHECKS_PER_SECOND",
    "RoundConfirmation",
    "check_period",
    "member_lost",
]

CHECKS_PER_SECOND = 2000.0
"""The most state checks per second the members of a round make while they wait to confirm."""


def check_period(world_size: int, dead_after: float) -> float:
    """Return how often a member waiting to confirm checks that no member was lost.

    A member is lost by an eviction, which comes a dead-node timeout after
    the seal at the soonest, so a check every quarter of that timeout finds
    it late by at most a quarter; never more often than every 0.25 s, and in
    rounds over 500 members less often, so a round stays within
    :data:`CHECKS_PER_SECOND` (but at least once a second, or once a quarter
    timeout if that is longer).
    """
    quarter = dead_after / 4
    return min(max(1.0, quarter), max(0.25, world_size / CHECKS_PER_SECOND, quarter))


@dataclass(frozen=True)
class RoundConfirmation:
    """The confirmation of one sealed round.

    Attributes:
        queue: The confirmation queues.
        verdicts: Where the verdict is kept and waited for.
        round_id: The sealed round.
        world_size: Its number of participants.
        participants: Returns its participants in rank order (read only to
            name those that did not confirm).
    """

    queue: JoinQueueBackend
    verdicts: VerdictBackend
    round_id: int
    world_size: int
    participants: Callable[[], Sequence[str]]

    def confirm(self, node: str) -> None:
        """Count ``node`` in; once every participant is counted, write the verdict (see the module).

        Only members confirm, so ``world_size`` distinct nodes are every participant.
        """
        position = self.queue.enqueue(self.round_id, node.encode())
        if position >= self.world_size and len(self._confirmed()) >= self.world_size:
            self.verdicts.set_verdict(self.round_id)

    def _confirmed(self) -> set[str]:
        return {r.decode("utf-8", "replace") for r in self.queue.queue_records(self.round_id)}

    def wait(
        self, seconds: float, clock: Clock = REAL_TIME, token: Token | None = None
    ) -> bool | None:
        """Wait up to ``seconds`` on ``clock`` for every member to confirm.

        True once they did; False when the state was written after the
        write of ``token`` (the state a member read); None when the time ran out.
        """
        with clock.blocking(seconds):
            return self.verdicts.wait_for_verdict(self.round_id, token, seconds)

    def unconfirmed(self) -> list[str]:
        """Return the participants that have not confirmed yet, in rank order."""
        confirmed = self._confirmed()
        return [n for n in self.participants() if n not in confirmed]


def member_lost(round_id: int, world_size: int, stored: RendezvousState | None) -> bool:
    """Tell whether a round awaiting confirmation lost a member, so it never completes.

    A close that came after the seal does not count: every live member still
    confirms (see :func:`rdzv.dynamic.machine.decide`). True when the round
    is gone from the store or a member was evicted.
    """
    if stored is None or stored.round != round_id:
        return True
    return stored.live_count < world_size
