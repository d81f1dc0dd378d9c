"""A node kept out of a run: the exclusion record, its rules, its safe codec and where it lives.

Theory of operation. ``rdzv run`` can check a node's health before each
join (:mod:`rdzv.launch.health`) and keep out a node that keeps failing.
Each node keeps one record in the run's store, under its own name (its
address), outside every round's prefix so that it outlives the rounds:

* ``failures``: the node's failures in a row. A failure is a failed health
  check, or an attempt of the job in which this node's workers failed first
  (counted only when exclusion is on). A passing health check after failed
  ones, or an attempt that ends otherwise (success, a re-form, a peer's
  failure), starts the count again (:meth:`ExclusionRecord.passed_check`,
  :meth:`ExclusionRecord.attempt_ended_well`);
* once ``failures`` reaches the policy's ``after`` (K), the node is
  excluded: it stays out until ``until``, a reading of the writer's clock
  ``cooldown`` seconds on. The cool-down doubles at each exclusion (the
  policy's initial one, 2x, 4x, ... up to :data:`MAX_COOLDOWN`) and the
  count starts again, so after a cool-down the node has K more tries;
* ``reason``: the last failure, in one line.

The rules are pure functions of the record and ``now``; the caller owns
the clock. ``until`` is a wall-clock time (the agent's injected clock reads
``time.time`` in production) so that ``rdzv status`` can show it and a new
agent of the same node, after a restart, still honours it; the time left
is never more than the cool-down, so a clock that steps back cannot keep a
node out longer than that.

The store is not trusted: a record that does not decode is an
:class:`ExclusionRecordError`, never another exception. The run keeps a list
of the nodes that have a record (one name per line, appended when a node
writes its first), which ``rdzv status`` reads.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, TypeGuard

from rdzv.first_failure import cut, json_record, printable
from rdzv.keys import exclusion_index_key, exclusion_key
from rdzv.store.base import Store

__all__ = [
    "KIND_HEALTH",
    "KIND_WORKERS",
    "MAX_COOLDOWN",
    "ExclusionPolicy",
    "ExclusionRecord",
    "ExclusionRecordError",
    "check_node_name",
    "decode_record",
    "encode_record",
    "read_record",
    "read_current",
    "read_records",
    "write_record",
]

#: The kind of a failed health check.
KIND_HEALTH = "health"
#: The kind of an attempt in which this node's workers failed first.
KIND_WORKERS = "workers"

#: The longest cool-down, in seconds (a day), however often a node was excluded.
MAX_COOLDOWN = 86400.0

_VERSION = 1
_MAX_RECORD_BYTES = 4096
_MAX_REASON = 600
_MAX_LISTED = 1024
_KINDS = ("", KIND_HEALTH, KIND_WORKERS)
_NODE = re.compile(r"[A-Za-z0-9._:%\[\]-]{1,200}")
_INT_RANGE = range(1 << 31)


class ExclusionRecordError(ValueError):
    """A value in the store is not an exclusion record (the message says why)."""


def check_node_name(node: str) -> str:
    """Return ``node`` if it can name a node's record (an address or host name).

    Raises:
        ValueError: It is empty, too long, or holds a character other than
            letters, digits and ``._:%[]-``.
    """
    if not _NODE.fullmatch(node):
        raise ValueError(
            f"the node name {node!r} cannot name an exclusion record (1-200 letters, "
            "digits or ._:%[]-)"
        )
    return node


@dataclass(frozen=True)
class ExclusionPolicy:
    """When a node is excluded, and for how long.

    Args:
        after: Failures in a row that exclude the node (K); 0: never.
        cooldown: Seconds of the first exclusion; each later one is twice
            the one before, up to :data:`MAX_COOLDOWN`.

    Raises:
        ValueError: ``after`` is negative or ``cooldown`` is not a positive
            number of seconds up to :data:`MAX_COOLDOWN`.
    """

    after: int = 0
    cooldown: float = 60.0

    def __post_init__(self) -> None:
        if isinstance(self.after, bool) or not isinstance(self.after, int) or self.after < 0:
            raise ValueError(f"exclude_after must be a non-negative integer, got {self.after!r}")
        if not 0 < self.cooldown <= MAX_COOLDOWN:
            raise ValueError(
                f"exclude_cooldown must be positive seconds up to {MAX_COOLDOWN:g}, "
                f"got {self.cooldown!r}"
            )

    @property
    def enabled(self) -> bool:
        """Whether failures can exclude a node."""
        return self.after > 0

    def cooldown_of(self, exclusion: int) -> float:
        """Return the cool-down of a node's ``exclusion``-th exclusion (the first is 1)."""
        doublings = min(max(exclusion - 1, 0), 64)
        return min(self.cooldown * 2.0**doublings, MAX_COOLDOWN)


@dataclass(frozen=True)
class ExclusionRecord:
    """A node's failures in a row and its exclusions, as kept in the run's store.

    Args:
        node: The node's name (its address).
        failures: Its failures in a row since the count last started.
        exclusions: Times it was excluded.
        kind: The kind of its last failure: :data:`KIND_HEALTH`,
            :data:`KIND_WORKERS`, or "" when none.
        reason: Its last failure, in one line.
        cooldown: Seconds of its last exclusion (0: never excluded).
        until: The writer's clock reading (wall time) at which its last
            exclusion ends.
    """

    node: str
    failures: int = 0
    exclusions: int = 0
    kind: str = ""
    reason: str = ""
    cooldown: float = 0.0
    until: float = 0.0

    def failed(
        self, kind: str, reason: str, now: float, policy: ExclusionPolicy
    ) -> ExclusionRecord:
        """Return the record after a failure at ``now``: one more in a row, maybe an exclusion."""
        failures = self.failures + 1
        record = replace(self, failures=failures, kind=kind, reason=cut(reason, _MAX_REASON))
        if not policy.enabled or failures < policy.after:
            return record
        exclusions = self.exclusions + 1
        cooldown = policy.cooldown_of(exclusions)
        return replace(
            record, failures=0, exclusions=exclusions, cooldown=cooldown, until=now + cooldown
        )

    def passed_check(self) -> ExclusionRecord:
        """Return the record after a passing health check: a run of failed checks ends."""
        return self.attempt_ended_well() if self.kind == KIND_HEALTH else self

    def attempt_ended_well(self) -> ExclusionRecord:
        """Return the record after an attempt whose workers did not fail first: the count restarts."""
        return replace(self, failures=0, kind="")

    def left(self, now: float) -> float:
        """Return the seconds of exclusion left at ``now`` (0 when none; never over the cool-down)."""
        return min(max(self.until - now, 0.0), self.cooldown)

    def excluded(self, now: float) -> bool:
        """Tell whether the node is excluded at ``now``."""
        return self.left(now) > 0

    def describe(self, now: float) -> str:
        """Return one line: the node, whether it is excluded and until when, and why.

        Text read from a store has its terminal control characters escaped.
        """
        if self.excluded(now):
            until = time.strftime("%H:%M:%S", time.localtime(self.until))
            text = (
                f"{self.node} excluded until {until} ({self.left(now):.0f} s left of "
                f"{self.cooldown:g} s, exclusion {self.exclusions})"
            )
        elif self.failures:
            text = f"{self.node} failed {self.failures} time(s) in a row, not excluded"
        else:
            text = f"{self.node} not excluded (excluded {self.exclusions} time(s) before)"
        if self.reason:
            text += f": {self.reason}"
        return printable(text)


def encode_record(record: ExclusionRecord) -> bytes:
    """Encode a record (its reason cut to its limit)."""
    data: dict[str, Any] = {"v": _VERSION, **asdict(record)}
    data["reason"] = cut(record.reason, _MAX_REASON)
    return json.dumps(data, separators=(",", ":")).encode("ascii")


def decode_record(raw: bytes) -> ExclusionRecord:
    """Decode a record read from a store.

    Raises:
        ExclusionRecordError: It is too long, not JSON, of another version,
            or a field is missing, of the wrong type or out of range.
    """
    data = json_record(raw, _MAX_RECORD_BYTES, _VERSION, ExclusionRecordError)
    node, kind, reason = data.get("node"), data.get("kind"), data.get("reason")
    if not isinstance(node, str) or not _NODE.fullmatch(node):
        raise ExclusionRecordError(f"node {node!r} is not a node name")
    if kind not in _KINDS:
        raise ExclusionRecordError(f"kind {kind!r} is not one of {_KINDS}")
    if not isinstance(reason, str) or len(reason) > _MAX_REASON:
        raise ExclusionRecordError(f"reason is not a string of at most {_MAX_REASON} chars")
    failures, exclusions = data.get("failures"), data.get("exclusions")
    if not _count(failures) or not _count(exclusions):
        raise ExclusionRecordError("failures and exclusions must be non-negative 32-bit integers")
    cooldown, until = data.get("cooldown"), data.get("until")
    if not _number_within(cooldown, MAX_COOLDOWN) or not _number_within(until, 1e11):
        raise ExclusionRecordError("cooldown and until must be non-negative seconds in range")
    return ExclusionRecord(node, failures, exclusions, kind, reason, float(cooldown), float(until))


def _count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value in _INT_RANGE


def _number_within(value: object, high: float) -> TypeGuard[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return math.isfinite(value) and 0 <= value <= high


def read_record(store: Store, run_id: str, node: str) -> ExclusionRecord | None:
    """Read a node's record from the run's store (None when it has none).

    Raises:
        RendezvousError: The store cannot be read.
        ExclusionRecordError: The stored value is not a record.
    """
    raw = store.try_multi_get([exclusion_key(run_id, node)])[0]
    return None if raw is None else decode_record(raw)


def write_record(store: Store, run_id: str, record: ExclusionRecord, *, first: bool) -> None:
    """Write a node's record; ``first``: it had none, so list the node for ``rdzv status``.

    Raises:
        RendezvousError: The store cannot be written.
    """
    store.set(exclusion_key(run_id, record.node), encode_record(record))
    if first:
        store.append(exclusion_index_key(run_id), f"{record.node}\n".encode("ascii"))


def read_records(store: Store, run_id: str) -> tuple[list[ExclusionRecord], list[str]]:
    """Read every listed node's record (at most 1,024 nodes): the records, and notes on bad ones.

    Raises:
        RendezvousError: The store cannot be read.
    """
    raw = store.try_multi_get([exclusion_index_key(run_id)])[0]
    if raw is None:
        return [], []
    names = list(dict.fromkeys(raw.decode("ascii", "replace").split()))[:_MAX_LISTED]
    nodes = [name for name in names if _NODE.fullmatch(name)]
    records, notes = [], []
    values = store.try_multi_get([exclusion_key(run_id, node) for node in nodes]) if nodes else []
    for node, value in zip(nodes, values, strict=True):
        if value is None:
            continue
        try:
            records.append(decode_record(value))
        except ExclusionRecordError as exc:
            notes.append(f"the exclusion record of {node} does not decode and was ignored ({exc})")
    return records, notes


def read_current(store: Store, run_id: str, now: float) -> tuple[list[ExclusionRecord], list[str]]:
    """Read the records of the nodes excluded at ``now`` or failing now, and notes on bad ones.

    Raises:
        RendezvousError: The store cannot be read.
    """
    records, notes = read_records(store, run_id)
    return [r for r in records if r.excluded(now) or r.failures], notes
