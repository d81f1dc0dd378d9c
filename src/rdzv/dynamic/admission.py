"""Admission rules beyond torch's: who a seal admits, and in which rank order.

Theory of operation
-------------------
Torch's rule (and rdzv's default) admits the members of the last round that
re-joined first, then the other queued nodes in arrival order, up to
``max_nodes``, and orders the newcomers naturally by address
(:func:`~rdzv.dynamic.state.assign_ranks`). :class:`Admission` names the
rules an operator may add; with none of them set, :func:`admit` *is*
``assign_ranks`` and the machine decides exactly as before.

* ``target_nodes`` T: the round seals at once when T nodes joined (as it
  does at ``max_nodes``); between ``min_nodes`` and T it waits the last call.
  The machine reads it as :attr:`Limits.seal_at
  <rdzv.dynamic.machine.Limits.seal_at>`; admission itself still takes up to
  ``max_nodes``.
* ``node_multiple`` K and ``segment_size`` S make the round's size a
  multiple of a *unit* (their least common multiple): the bounds become the
  multiples of the unit inside ``[min_nodes, max_nodes]`` (:meth:`Admission.bounds`)
  and a round takes the largest size its nodes allow (:func:`round_size`);
  the others are spares.
* ``segment_size`` S (with ``rank_order_key``): a round holds whole
  topology segments only, S nodes that published the same key value; a key
  value with 2S nodes gives two segments, the remainder waits.
* ``rank_order_key``: ranks follow (key value, natural node order).
* ``keep_ranks``: every member of the last round keeps its rank and a
  newcomer takes the rank of a member that did not come back; gaps nobody
  fills close up, so only the ranks above a gap move down.

Priority never changes: a member of the last round (evicted ones that
re-join included) is admitted before any newcomer, whenever it enqueued.
Node ranks that every admitted node asked for, all distinct, win over every
ordering rule, as they do today.

Everything here is pure: the records carry each node's key value
(:attr:`~rdzv.dynamic.state.JoinRecord.topology`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from rdzv.dynamic.state import JoinRecord, assign_ranks, natural_key, node_address

__all__ = ["Admission", "admit", "grows", "round_size"]


def _positive(value: object, key: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class Admission:
    """The admission rules of a run (all off by default).

    Attributes:
        target_nodes: Seal at once when this many joined; None: at ``max_nodes``.
        node_multiple: A round's size is a multiple of it.
        keep_ranks: Members keep their rank across re-formations; newcomers
            fill the ranks of members that did not come back.
        rank_order_key: The environment variable whose value each node
            publishes with its join; ranks are ordered by it.
        segment_size: A round holds only whole groups of this many nodes
            with the same key value.

    Raises:
        ValueError: A value is invalid; the message names its key.
    """

    target_nodes: int | None = None
    node_multiple: int = 1
    keep_ranks: bool = False
    rank_order_key: str | None = None
    segment_size: int | None = None

    def __post_init__(self) -> None:
        if self.target_nodes is not None:
            _positive(self.target_nodes, "target_nodes")
        _positive(self.node_multiple, "node_multiple")
        if self.segment_size is not None:
            _positive(self.segment_size, "segment_size")
            if not self.rank_order_key:
                raise ValueError(
                    "segment_size needs rank_order_key: a segment is the nodes sharing its value"
                )
        if self.rank_order_key is not None and not self.rank_order_key.strip():
            raise ValueError("rank_order_key must name an environment variable")

    @property
    def default(self) -> bool:
        """Whether no rule is set: admission is torch's."""
        return self == _DEFAULT

    @property
    def unit(self) -> int:
        """The number every round size is a multiple of."""
        return math.lcm(self.node_multiple, self.segment_size or 1)

    def bounds(self, min_nodes: int, max_nodes: int) -> tuple[int, int]:
        """Return the smallest and largest round size within ``[min_nodes, max_nodes]``.

        Raises:
            ValueError: No multiple of the unit lies between them, or the
                target is outside them or no multiple; the message names the key.
        """
        unit = self.unit
        low = -(-min_nodes // unit) * unit
        high = max_nodes // unit * unit
        if low > high:
            key = "node_multiple" if self.node_multiple > 1 else "segment_size"
            raise ValueError(
                f"{key}: no multiple of {unit} lies between min_nodes={min_nodes} "
                f"and max_nodes={max_nodes}"
            )
        target = self.target_nodes
        if target is not None and not (low <= target <= high and target % unit == 0):
            raise ValueError(
                f"target_nodes={target} must be a multiple of {unit} between "
                f"min_nodes={min_nodes} and max_nodes={max_nodes}"
            )
        return low, high


_DEFAULT = Admission()


def round_size(available: int, min_nodes: int, max_nodes: int, admission: Admission) -> int:
    """Return the size of a round ``available`` nodes allow, 0 when below ``min_nodes``.

    The largest multiple of the unit up to ``min(available, max_nodes)``.
    """
    unit = admission.unit
    size = min(available, max_nodes) // unit * unit
    return size if size >= min_nodes else 0


def _natural(record: JoinRecord) -> tuple[tuple[str | int, ...], ...]:
    return (natural_key(node_address(record.node)), natural_key(record.node))


def _order_key(record: JoinRecord, admission: Admission) -> tuple[tuple[str | int, ...], ...]:
    if admission.rank_order_key:
        return (natural_key(record.topology), *_natural(record))
    return _natural(record)


def _whole_segments(
    priority: Sequence[str], unique: dict[str, JoinRecord], size_of: int, segment: int
) -> list[str]:
    """Return the nodes of the whole segments a round takes, best first.

    A key value's nodes, in priority order, make ``len // segment``
    segments; segments rank by their best member, so those holding members
    of the last round come first.
    """
    groups: dict[str, list[str]] = {}
    for node in priority:
        groups.setdefault(unique[node].topology, []).append(node)
    rank = {node: i for i, node in enumerate(priority)}
    segments = [
        nodes[i : i + segment]
        for nodes in groups.values()
        for i in range(0, len(nodes) - segment + 1, segment)
    ]
    segments.sort(key=lambda s: rank[s[0]])
    return [node for s in segments[: size_of // segment] for node in s]


def admit(
    records: Sequence[JoinRecord],
    previous: Sequence[str],
    min_nodes: int,
    max_nodes: int,
    admission: Admission,
) -> tuple[str, ...]:
    """Choose a round's participants from its join ``records`` and order them by rank.

    ``previous`` are the last round's participants in rank order (evicted
    ones included). Returns fewer than ``min_nodes`` (possibly none) when no
    allowed round can be formed.
    """
    if admission.default:
        return assign_ranks(records, previous, max_nodes)
    unique: dict[str, JoinRecord] = {}
    for record in records:
        unique.setdefault(record.node, record)
    earlier = set(previous)
    priority = [n for n in previous if n in unique] + [n for n in unique if n not in earlier]
    if admission.segment_size:
        whole = _whole_segments(priority, unique, max_nodes, admission.segment_size)
        chosen = whole[: round_size(len(whole), min_nodes, max_nodes, admission)]
    else:
        chosen = priority[: round_size(len(priority), min_nodes, max_nodes, admission)]
    asked = [unique[n].node_rank for n in chosen]
    if chosen and all(r >= 0 for r in asked) and len(set(asked)) == len(asked):
        return tuple(sorted(chosen, key=lambda n: unique[n].node_rank))
    fresh = sorted(
        (n for n in chosen if n not in earlier), key=lambda n: _order_key(unique[n], admission)
    )
    if admission.keep_ranks and previous:
        return _fill_slots(previous, set(chosen), fresh)
    if admission.rank_order_key:
        return tuple(sorted(chosen, key=lambda n: _order_key(unique[n], admission)))
    admitted = set(chosen)
    return tuple([n for n in previous if n in admitted] + fresh)


def _fill_slots(previous: Sequence[str], chosen: set[str], fresh: list[str]) -> tuple[str, ...]:
    """Keep each returning member's slot; fill the others' slots with ``fresh`` nodes in order.

    Slots nobody fills close up (the ranks above move down); newcomers left
    over follow the last slot.
    """
    newcomers = iter(fresh)
    ranked: list[str] = []
    for node in previous:
        if node in chosen:
            ranked.append(node)
            continue
        filler = next(newcomers, None)
        if filler is not None:
            ranked.append(filler)
    ranked.extend(newcomers)
    return tuple(ranked)


def grows(
    live: int,
    queued: int,
    queued_records: Sequence[JoinRecord] | None,
    min_nodes: int,
    max_nodes: int,
    admission: Admission,
) -> bool:
    """Tell whether the ``queued`` nodes would make a round of ``live`` members larger.

    Always, by default (torch re-forms for any waiting node while the round
    has room). With a unit, only when a larger allowed size is reached; with
    segments, only when the queued nodes (``queued_records``) complete a
    whole segment. Unread records (None: a joining node that sees only the
    queue's length) cannot tell, and count as no segment: that node waits
    as a spare, without a join timeout, until the members re-form.
    """
    if admission.default:
        return True
    if round_size(live + queued, min_nodes, max_nodes, admission) <= live:
        return False
    segment = admission.segment_size
    if not segment:
        return True
    if queued_records is None:
        return False
    counts: dict[str, set[str]] = {}
    for record in queued_records:
        counts.setdefault(record.topology, set()).add(record.node)
    whole = sum(len(nodes) // segment for nodes in counts.values()) * segment
    return round_size(live + whole, min_nodes, max_nodes, admission) > live
