"""A member's seat in a sealed round: what it needs to know, in O(1) bytes.

A member of a round needs its rank, the world size, the bootstrap address
(rank 0's address and the port it holds) and the node it watches (its ring
successor); it does not need the participant list. The state lists every
participant, so at N members each member reading it reads O(N) bytes and
decodes O(N) keys: O(N^2) for a formation. The sealer therefore computes
every member's seat from the plan (:func:`seats_of`) and a backend with the
:class:`~rdzv.backends.base.SeatedBackend` capability stores them with the
seal; a member reads its own seat when the state's token changes and
reads the state only when it has none.

Every write of the state to such a backend also stores the state's
summary (:class:`~rdzv.dynamic.state.StateSummary`: the round, whether the
run is closed, the number of live participants) as the seat of the
pseudo-node :data:`SUMMARY_SEAT`. A node joining a round that is not sealed
yet decides on those three alone (:mod:`rdzv.dynamic.machine`), so it reads
the summary where it read the state: when it starts to join, and when a
write that seats it not (an eviction, a leave) changes the token, never
the whole participant list.

A seat also carries the successor's heartbeat mark as the sealer read it
just before the seal (:class:`SealedMark`, one read of every member's mark
for the sealer, none for the others). The member's ring judging then counts
the successor's silence from when it read its seat, not from its own first
reading of the mark, which comes after the round's verdict and a random
part of a ring period later: a node that
dies as the round completes is judged that much sooner. The mark was the
sealer's reading before the seat was written, so before the member read
it; counting from the member's reading never charges the successor for
time in which its mark could have changed unseen.

Encoding: ``b"1 <round> <rank> <world size> <port> <rank 0 key> <successor
key or -> [<successor's mark>]"``, ASCII; node keys hold no spaces; the
mark is ``-`` for a successor that had not beaten yet, else ``x`` and its
bytes in hex, and a seat without it (written by an older rdzv) carries no
sealed mark. :func:`decode_seat` validates every field and raises
:class:`~rdzv.errors.RendezvousStateError` for anything else, as for the
state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from rdzv.backends.base import Token, validate_node_key
from rdzv.dynamic.machine import successor_of
from rdzv.dynamic.state import RendezvousState
from rdzv.errors import RendezvousStateError

__all__ = [
    "MAX_SEALED_MARK",
    "Member",
    "SUMMARY_SEAT",
    "SealedMark",
    "Seat",
    "decode_seat",
    "encode_seat",
    "seats_of",
    "watching_seat",
]

_VERSION = b"1"
_NO_SUCCESSOR = "-"
_NO_MARK = b"-"
_MARK = b"x"
MAX_SEALED_MARK = 64
"""Longest heartbeat mark a seat carries, in bytes; a longer one (a stray
write to a heartbeat key) leaves the seat without a sealed mark, so the seat
stays O(1)."""

SUMMARY_SEAT = "#summary"
"""The pseudo-node whose seat is the state's summary; no node key starts
with ``#`` (:func:`~rdzv.dynamic.state.make_node_key` puts an address first),
and a backend stores it with the state, before the members' seats
(:func:`~rdzv.backends.base.is_pseudo_node`)."""


@dataclass(frozen=True)
class SealedMark:
    """The ring successor's heartbeat mark as the sealer read it, just before the seal.

    Attributes:
        mark: The mark; None when the successor had not beaten yet.
        read_at: The reading member's monotonic time when it read its seat
            (set by the member, never stored); None until then.
    """

    mark: bytes | None
    read_at: float | None = None


@dataclass(frozen=True)
class Seat:
    """One member's place in a sealed round.

    Attributes:
        round: The round.
        rank: The member's rank.
        world_size: The number of participants.
        master: Rank 0's node key (its address is ``MASTER_ADDR``).
        port: The bootstrap port rank 0 holds (``MASTER_PORT``); 0 when
            the seal does not know it (a stored seat always names it).
        successor: The node key of the next rank (wrapping), which this
            member watches; None in a round of one.
        sealed_mark: The successor's mark as the sealer read it; None when
            the seal did not read it (a seat computed from the state).
    """

    round: int
    rank: int
    world_size: int
    master: str
    port: int
    successor: str | None
    sealed_mark: SealedMark | None = None

    @classmethod
    def of(cls, state: RendezvousState, node: str) -> Seat | None:
        """Return ``node``'s seat in ``state`` as sealed, or None when it is no live member.

        The successor is the next live participant
        (:func:`rdzv.dynamic.machine.successor_of`).
        """
        rank = state.rank_of(node)
        if rank is None:
            return None
        return cls(
            state.round,
            rank,
            len(state.participants),
            state.participants[0],
            state.bootstrap_port,
            successor_of(state, node),
        )


def encode_seat(seat: Seat) -> bytes:
    """Encode a seat."""
    fields = (
        seat.round,
        seat.rank,
        seat.world_size,
        seat.port,
        seat.master,
        seat.successor or _NO_SUCCESSOR,
    )
    text = _VERSION + b" " + " ".join(str(f) for f in fields).encode("ascii")
    sealed = seat.sealed_mark
    if sealed is None:
        return text
    mark = _NO_MARK if sealed.mark is None else _MARK + sealed.mark.hex().encode("ascii")
    return text + b" " + mark


def decode_seat(data: bytes) -> Seat:
    """Decode and validate a stored seat.

    Raises:
        RendezvousStateError: The bytes are no valid seat.
    """
    parts = data.split(b" ")
    if len(parts) not in (7, 8) or parts[0] != _VERSION or not all(p.isdigit() for p in parts[1:5]):
        raise RendezvousStateError(f"a stored seat is corrupt: {data[:80]!r}")
    sealed = _decode_mark(parts[7]) if len(parts) == 8 else None
    round_id, rank, world_size, port = (int(p) for p in parts[1:5])
    try:
        master = validate_node_key(parts[5].decode("ascii"))
        successor_text = parts[6].decode("ascii")
        successor = None if successor_text == _NO_SUCCESSOR else validate_node_key(successor_text)
    except (UnicodeDecodeError, ValueError) as exc:
        raise RendezvousStateError(f"a stored seat names an invalid node key: {exc}") from exc
    if not (rank < world_size and 1 <= port <= 65535):
        raise RendezvousStateError(
            f"a stored seat is inconsistent: rank {rank} of {world_size}, port {port}"
        )
    return Seat(round_id, rank, world_size, master, port, successor, sealed)


def _decode_mark(field: bytes) -> SealedMark:
    if field == _NO_MARK:
        return SealedMark(None)
    if field[:1] == _MARK:
        try:
            return SealedMark(bytes.fromhex(field[1:].decode("ascii")))
        except (UnicodeDecodeError, ValueError):
            pass
    raise RendezvousStateError(f"a stored seat holds an invalid heartbeat mark: {field[:80]!r}")


def seats_of(
    state: RendezvousState, marks: Mapping[str, bytes | None] | None = None
) -> dict[str, bytes]:
    """Return every live member's encoded seat in a freshly sealed ``state``, in rank order.

    ``marks`` are the members' heartbeat marks as read before the seal; each
    seat carries its successor's (:class:`SealedMark`) unless it is missing
    or longer than :data:`MAX_SEALED_MARK`. None: no seat carries one.

    Each seat equals :meth:`Seat.of` for its node but for the sealed mark
    (``tests/dynamic/test_seat.py`` checks it), built in one pass:
    :meth:`Seat.of` looks the node up, which for every member would be
    quadratic.
    """
    live = [
        (rank, node) for rank, node in enumerate(state.participants) if rank not in state.evicted
    ]
    size = len(state.participants)
    seats: dict[str, bytes] = {}
    for index, (rank, node) in enumerate(live):
        successor = live[(index + 1) % len(live)][1] if len(live) > 1 else None
        sealed = None if marks is None or successor is None else _sealed(marks, successor)
        seat = Seat(
            state.round, rank, size, state.participants[0], state.bootstrap_port, successor, sealed
        )
        seats[node] = encode_seat(seat)
    return seats


def _sealed(marks: Mapping[str, bytes | None], node: str) -> SealedMark | None:
    """``node``'s mark for a seat; None when it was not read or is too long to carry."""
    if node not in marks:
        return None
    mark = marks[node]
    return None if mark is not None and len(mark) > MAX_SEALED_MARK else SealedMark(mark)


def watching_seat(state: RendezvousState, node: str) -> Seat | None:
    """Return ``node``'s seat in ``state`` for watching its ring, ``node`` itself counted live.

    A member that left its round to re-join (it evicted itself) keeps
    watching that round's ring until it completes another; its successor is
    the next participant nobody evicted. None when ``node`` is no participant.
    """
    own = {i for i in state.evicted if state.participants[i] == node}
    view = replace(state, evicted=state.evicted - own) if own else state
    return Seat.of(view, node)


@dataclass(frozen=True)
class Member:
    """The round this node is a member of, as it learned it.

    Attributes:
        seat: This node's seat.
        token: The token of the state this node learned it from: while it
            is stored, the round is as sealed.
        state: That state, when this node read it whole; None when it
            learned its place from its stored seat alone.
    """

    seat: Seat
    token: Token
    state: RendezvousState | None

    @property
    def round(self) -> int:
        """The round."""
        return self.seat.round

    @classmethod
    def of(cls, state: RendezvousState | None, token: Token, node: str) -> Member:
        """Return ``node``'s membership of ``state``, which seats it (``Complete`` was decided)."""
        # Complete is decided only on a sealed state that holds this node.
        assert state is not None
        seat = Seat.of(state, node)
        assert seat is not None
        return cls(seat, token, state)
