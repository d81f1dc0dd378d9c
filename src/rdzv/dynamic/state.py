"""The shared rendezvous state, node keys, join records and their codecs.

The state is small on purpose: the number of the last sealed round, its
participants in rank order (node keys), which of them were removed since
(evicted: dead or left), and whether the run is closed. Joins and heartbeats
live in their own records (see ``rdzv.backends.base``), so nobody rewrites
the state to join or to stay alive.

Encoding: one version byte followed by compact UTF-8 JSON. Version 1 is
``[round, closed, [node keys...], [evicted indices...]]``; version 2 adds
the bootstrap port rank 0 holds, ``[round, closed, [node keys...],
[evicted indices...], port]``, so the seal itself tells every member where
the bootstrap store is (``MASTER_ADDR`` is rank 0's address, the address
part of its node key). A state without a port is written as version 1, so
readers of version 1 still read it. It is never pickle; :func:`decode_state`
validates every field and raises :class:`~rdzv.errors.RendezvousStateError`
for anything else.

A state's summary (:class:`StateSummary`: its round, whether it is closed,
its number of live participants; what a node joining a later round decides
on) is ``b"S1 <round> <closed: 0 or 1> <live count>"``.

A join record is ``b"<node key> <node rank>"``, or ``b"<node key> <node
rank> <port>"`` from a node that holds a port for the bootstrap store, or
``b"<node key> <node rank> <port or 0> t=<topology>"`` from a node that
publishes a rank-order key value (``rank_order_key``; never by default).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from rdzv.backends.base import validate_node_key
from rdzv.errors import RendezvousStateError

__all__ = [
    "MAX_PARTICIPANTS",
    "STATE_VERSION",
    "JoinRecord",
    "RendezvousState",
    "StateSummary",
    "assign_ranks",
    "decode_record",
    "decode_state",
    "decode_summary",
    "encode_record",
    "encode_state",
    "encode_summary",
    "is_topology_value",
    "make_node_key",
    "natural_key",
    "node_address",
]

STATE_VERSION = 2
"""The newest state encoding this rdzv writes (it reads 1 and 2)."""
_SUMMARY_VERSION = b"S1"
MAX_PARTICIPANTS = 65_536
"""The most participants a stored state may list; a longer list is a corrupt state.

It bounds the work a forged state can cause: every reader decodes the list,
and leaders read one heartbeat mark per missing member.
"""
_MAX_STATE_BYTES = 64 * 1024 * 1024
_DIGITS = re.compile(r"(\d+)")
# The bytes a node key may hold (printable ASCII but space), and the newline
# that :func:`_all_ascii_keys` joins keys with.
_KEY_BYTES = bytes(range(0x21, 0x7F)) + b"\n"


def make_node_key(addr: str, pid: int, nonce: str) -> str:
    """Build the key naming one handler: ``addr#pid#nonce``.

    ``addr`` is numeric (an IPv6 scope is dropped); the nonce tells apart
    handlers in one process.

    Raises:
        ValueError: The result is not a valid node key.
    """
    return validate_node_key(f"{addr.split('%', 1)[0]}#{pid}#{nonce}")


def node_address(node: str) -> str:
    """Return the address part of a node key (the whole key when it has no ``#``)."""
    return node.split("#", 1)[0]


def natural_key(text: str) -> tuple[str | int, ...]:
    """Return a sort key that orders digit runs by value (``node7`` < ``node66``).

    The key alternates the text between digit runs (at even positions,
    possibly empty at the ends) and the digit runs' values (at odd ones), so
    two keys compare element by element with like types: a number sorts
    before any text at the same place. A seal sorts every new node by it,
    so it builds no tagged tuple per run.
    """
    parts: list[Any] = _DIGITS.split(text)
    parts[1::2] = map(int, parts[1::2])
    return tuple(parts)


@dataclass(frozen=True)
class RendezvousState:
    """The state of a run.

    Attributes:
        round: The last sealed round, or -1 before the first.
        participants: The node keys of that round, in rank order.
        evicted: Indices into ``participants`` of members removed since.
        closed: Whether the run is closed.
        bootstrap_port: The port rank 0 holds for the bootstrap store, or 0
            when it is not known (rank 0 then publishes it in the round's
            store).
    """

    round: int = -1
    participants: tuple[str, ...] = ()
    evicted: frozenset[int] = frozenset()
    closed: bool = False
    bootstrap_port: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.round, bool) or not isinstance(self.round, int) or self.round < -1:
            raise ValueError(f"round must be an integer >= -1, got {self.round!r}")
        if self.round == -1 and self.participants:
            raise ValueError("a state before the first round has no participants")
        if len(set(self.participants)) != len(self.participants):
            raise ValueError("participants must be distinct")
        for index in self.evicted:
            if not 0 <= index < len(self.participants):
                raise ValueError(f"evicted index {index} is out of range")
        if not _is_int(self.bootstrap_port) or not 0 <= self.bootstrap_port <= 65535:
            raise ValueError(f"bootstrap_port must be in 0..65535, got {self.bootstrap_port!r}")

    @property
    def next_round(self) -> int:
        """The round a node joining now enqueues for."""
        return self.round + 1

    @property
    def live_count(self) -> int:
        """The number of participants not evicted."""
        return len(self.participants) - len(self.evicted)

    def live_participants(self) -> tuple[str, ...]:
        """Return the participants not evicted, in rank order."""
        if not self.evicted:
            return self.participants
        return tuple(n for i, n in enumerate(self.participants) if i not in self.evicted)

    def rank_of(self, node: str) -> int | None:
        """Return the rank of a live participant; None for any other node."""
        try:
            index = self.participants.index(node)
        except ValueError:
            return None
        return None if index in self.evicted else index

    def evict(self, nodes: Iterable[str]) -> RendezvousState:
        """Return the state with ``nodes`` (non-participants ignored) removed from the live ones."""
        positions = {n: i for i, n in enumerate(self.participants)}
        added = {positions[n] for n in nodes if n in positions}
        return replace(self, evicted=self.evicted | added)

    def close(self) -> RendezvousState:
        """Return the state marked closed."""
        return replace(self, closed=True)


def encode_state(state: RendezvousState) -> bytes:
    """Encode a state: version 2 when it carries a bootstrap port, else version 1."""
    body: list[object] = [
        state.round,
        int(state.closed),
        list(state.participants),
        sorted(state.evicted),
    ]
    version = 1
    if state.bootstrap_port:
        body.append(state.bootstrap_port)
        version = 2
    return bytes([version]) + json.dumps(body, separators=(",", ":")).encode()


def _all_ascii_keys(nodes: tuple[object, ...]) -> bool:
    """Tell whether every item is a node key of 1 to 256 printable ASCII characters.

    Every check runs in C (a state of thousands of members is decoded by
    every member): the join raises ``TypeError`` on an item that is not a
    string; joined by newlines, the keys are printable ASCII exactly when
    deleting the printable bytes and the newlines leaves nothing, and hold no
    newline of their own when there is one less newline than keys.
    """
    if not nodes:
        return True
    try:
        joined = "\n".join(nodes)  # type: ignore[arg-type]  # a non-str raises TypeError
        lengths = list(map(len, nodes))  # type: ignore[arg-type]
    except TypeError:
        return False
    if not joined.isascii():
        return False
    data = joined.encode("ascii")
    return (
        not data.translate(None, _KEY_BYTES)
        and data.count(b"\n") == len(nodes) - 1
        and min(lengths) >= 1
        and max(lengths) <= 256
    )


def _bad(reason: str) -> RendezvousStateError:
    return RendezvousStateError(f"the stored rendezvous state is invalid: {reason}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def decode_state(data: bytes) -> RendezvousState:
    """Decode and validate a stored state.

    Raises:
        RendezvousStateError: The bytes are not a valid state of a version this codec reads (1 or 2).
    """
    if not isinstance(data, (bytes, bytearray)) or not data:
        raise _bad("it is empty")
    if len(data) > _MAX_STATE_BYTES:
        raise _bad(f"{len(data)} bytes is more than the {_MAX_STATE_BYTES}-byte limit")
    version = data[0]
    if version not in (1, 2):
        raise _bad(f"unknown version {version} (this rdzv reads versions 1 and 2)")
    try:
        body = json.loads(bytes(data[1:]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        # RecursionError: arrays nested deeper than the interpreter's stack
        # (found by tests/fuzz/test_fuzz_state_codec.py).
        raise _bad(f"it is not JSON ({exc})") from exc
    if version == 1 and (not isinstance(body, list) or len(body) != 4):
        raise _bad("expected [round, closed, participants, evicted]")
    if version == 2 and (not isinstance(body, list) or len(body) != 5):
        raise _bad("expected [round, closed, participants, evicted, port]")
    round_no, closed, participants, evicted = body[:4]
    port = body[4] if version == 2 else 0
    if version == 2 and (not _is_int(port) or not 0 < port <= 65535):
        raise _bad(f"bad bootstrap port {port!r}")
    if not _is_int(round_no) or closed not in (0, 1) or isinstance(closed, bool):
        raise _bad(f"bad round {round_no!r} or closed flag {closed!r}")
    if not isinstance(participants, list) or not isinstance(evicted, list):
        raise _bad("participants and evicted must be lists")
    if len(participants) > MAX_PARTICIPANTS:
        raise _bad(
            f"it lists {len(participants)} participants; the limit is "
            f"MAX_PARTICIPANTS = {MAX_PARTICIPANTS}"
        )
    if not all(_is_int(i) for i in evicted) or len(set(evicted)) != len(evicted):
        raise _bad("evicted must hold distinct integers")
    try:
        nodes = tuple(participants)
        if not _all_ascii_keys(nodes):
            nodes = tuple(validate_node_key(n) for n in participants)
        return RendezvousState(round_no, nodes, frozenset(evicted), bool(closed), port)
    except ValueError as exc:
        raise _bad(str(exc)) from exc


@dataclass(frozen=True)
class JoinRecord:
    """What a joining node enqueues.

    Attributes:
        node: Its node key.
        node_rank: The rank it asks for, or -1 for none.
        port: The port it holds for the bootstrap store should it be rank
            0, or 0 for none.
        topology: The value of its rank-order key (see
            :mod:`rdzv.dynamic.admission`), or empty for none.
    """

    node: str
    node_rank: int = -1
    port: int = 0
    topology: str = ""


def encode_record(record: JoinRecord) -> bytes:
    """Encode a join record as ``b"<node key> <node rank>[ <port>[ t=<topology>]]"``."""
    if record.topology:
        return f"{record.node} {record.node_rank} {record.port} t={record.topology}".encode()
    if record.port:
        return f"{record.node} {record.node_rank} {record.port}".encode()
    return f"{record.node} {record.node_rank}".encode()


def decode_record(data: bytes) -> JoinRecord:
    """Decode and validate a join record.

    Raises:
        RendezvousStateError: The bytes are not a valid join record.
    """
    try:
        node, rank_text, *port_text = data.decode("utf-8").split(" ")
        node_rank = int(rank_text)
        validate_node_key(node)
    except (UnicodeDecodeError, ValueError) as exc:
        raise RendezvousStateError(f"a stored join record is invalid: {data[:80]!r}") from exc
    if node_rank < -1:
        raise RendezvousStateError(f"a stored join record has a bad node rank: {data[:80]!r}")
    if not port_text:
        return JoinRecord(node, node_rank)
    port, *topology = port_text
    lowest = 0 if topology else 1
    if len(topology) > 1 or not (
        port.isascii() and port.isdigit() and lowest <= int(port) <= 65535
    ):
        raise RendezvousStateError(f"a stored join record has a bad port: {data[:80]!r}")
    value = topology[0].removeprefix("t=") if topology else ""
    if topology and (not topology[0].startswith("t=") or not is_topology_value(value)):
        raise RendezvousStateError(f"a stored join record has a bad topology: {data[:80]!r}")
    return JoinRecord(node, node_rank, int(port), value)


def is_topology_value(value: str) -> bool:
    """Tell whether ``value`` can be published as a rank-order key value.

    1 to 256 printable ASCII characters, no space (a join record separates
    its fields by spaces).
    """
    return 0 < len(value) <= 256 and value.isascii() and value.isprintable() and " " not in value


def assign_ranks(
    records: Sequence[JoinRecord], previous: Sequence[str], max_nodes: int
) -> tuple[str, ...]:
    """Choose a round's participants from its join queue and order them by rank.

    Duplicates (a retried enqueue) count once. Members of the previous round
    are admitted first, then the others in arrival order, up to
    ``max_nodes``. When every admitted node asked for a rank and the ranks
    are distinct, they are honoured; otherwise previous members keep their
    relative order and the new nodes follow, sorted naturally by address
    (``node7`` before ``node66``).
    """
    unique: dict[str, JoinRecord] = {}
    for record in records:
        unique.setdefault(record.node, record)
    survivors = [n for n in previous if n in unique]
    survivor_set = set(survivors)
    newcomers = [n for n in unique if n not in survivor_set]
    admitted = (survivors + newcomers)[:max_nodes]
    asked = [unique[n].node_rank for n in admitted]
    if all(r >= 0 for r in asked) and len(set(asked)) == len(asked):
        return tuple(sorted(admitted, key=lambda n: unique[n].node_rank))
    kept = [n for n in admitted if n in survivor_set]
    fresh = sorted(
        (n for n in admitted if n not in survivor_set),
        key=lambda n: (natural_key(node_address(n)), natural_key(n)),
    )
    return tuple(kept + fresh)


@dataclass(frozen=True)
class StateSummary:
    """What a node joining a round that is not sealed yet needs of the state.

    It names no participant: it cannot tell a node whether it is a member.

    Attributes:
        round: The last sealed round, or -1 before the first.
        closed: Whether the run is closed.
        live_count: The number of participants not evicted.
    """

    round: int
    closed: bool
    live_count: int

    @property
    def next_round(self) -> int:
        """The round a node joining now enqueues for."""
        return self.round + 1

    @classmethod
    def of(cls, state: RendezvousState) -> StateSummary:
        """Return the summary of ``state``."""
        return cls(state.round, state.closed, state.live_count)


def encode_summary(summary: StateSummary) -> bytes:
    """Encode a state's summary."""
    return b"%s %d %d %d" % (_SUMMARY_VERSION, summary.round, summary.closed, summary.live_count)


def decode_summary(data: bytes) -> StateSummary:
    """Decode and validate a stored summary.

    Raises:
        RendezvousStateError: The bytes are no valid summary.
    """
    parts = data.split(b" ")
    if (
        len(parts) != 4
        or parts[0] != _SUMMARY_VERSION
        or not (parts[1].isdigit() or parts[1] == b"-1")
        or parts[2] not in (b"0", b"1")
        or not parts[3].isdigit()
        or len(parts[1]) > 20
        or len(parts[3]) > 20
    ):
        raise RendezvousStateError(f"a stored state summary is corrupt: {data[:80]!r}")
    return StateSummary(int(parts[1]), parts[2] == b"1", int(parts[3]))
