"""How the etcd backend keeps a seal's seats: in a fixed number of keys, a member's by its key's hash.

Theory of operation
-------------------
A seat is a member's place in a sealed round in O(1) bytes
(:class:`~rdzv.backends.base.SeatedBackend`). etcd takes at most 128
operations in one transaction, too few for a key per member of thousands,
and seats written outside the seal's transaction either queue behind the
members' own writes or cost the members a second wait (two designs tried,
``docs/history/engines.md``). So a seal puts its seats in the same
transaction as the state, spread over :data:`SEAT_GROUPS` keys: a member's
seat goes to the group of its key's CRC-32, a pseudo-node's (the state's
summary) to a key of its own. A member then reads one group, about
``N / SEAT_GROUPS`` seats, where it read the whole state (the sizes:
``docs/engines.md``). A group key written by the
seal has the seal's revision, which is the state's token: a group whose
revision is another write's holds no seat of that write.

This module only names the keys and packs and unpacks a group; it does no
I/O. A group is the concatenation of ``b"<len(node)> <len(seat)> "``, the
node key and the seat, for each of its seats.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping

from rdzv.backends.base import is_pseudo_node
from rdzv.errors import RendezvousStateError

__all__ = ["SEAT_GROUPS", "group_name", "pack_groups", "unpack_seat"]

SEAT_GROUPS = 120
"""The keys a seal spreads its members' seats over: with the compare, the state,
its head and the summary, a seal stays within etcd's default 128 operations
a transaction."""


def group_name(node: str) -> bytes:
    """Return the name of the key that holds ``node``'s seat (a pseudo-node's own key)."""
    if is_pseudo_node(node):
        return node.encode()
    return b"g%d" % (zlib.crc32(node.encode()) % SEAT_GROUPS)


def pack_groups(seats: Mapping[str, bytes]) -> dict[bytes, bytes]:
    """Return ``{group name: packed seats}`` of ``seats`` (validated node keys and seats)."""
    groups: dict[bytes, list[bytes]] = {}
    for node, seat in seats.items():
        key = node.encode()
        groups.setdefault(group_name(node), []).append(
            b"%d %d " % (len(key), len(seat)) + key + seat
        )
    return {name: b"".join(parts) for name, parts in groups.items()}


def unpack_seat(group: bytes, node: str) -> bytes | None:
    """Return ``node``'s seat in a packed group, or None if it has none.

    Raises:
        RendezvousStateError: The group is not packed seats.
    """
    key = node.encode()
    at = 0
    while at < len(group):
        entry = _entry(group, at)
        if entry is None:
            raise RendezvousStateError(
                f"an etcd seat group holds something other than packed seats (at byte {at})"
            )
        start, split, at = entry
        if group[start:split] == key:
            return group[split:at]
    return None


def _entry(group: bytes, at: int) -> tuple[int, int, int] | None:
    """Return where the entry at ``at`` has its node key, its seat and its end; None if malformed."""
    first = group.find(b" ", at)
    second = group.find(b" ", first + 1)
    node_len, seat_len = group[at:first], group[first + 1 : second]
    if first < 0 or second < 0 or not (node_len.isdigit() and seat_len.isdigit()):
        return None
    start = second + 1
    split = start + int(node_len)
    end = split + int(seat_len)
    return (start, split, end) if split > start and end > split and end <= len(group) else None
