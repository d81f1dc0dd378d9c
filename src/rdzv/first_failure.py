"""The first-failure record: what it holds, its safe codec, and where it lives.

``rdzv run``'s agents record the first worker failure of each round once for
the whole job (:mod:`rdzv.launch.failures` says how); ``rdzv status`` shows
the run's last one. This module is what both read and write:

* :class:`FailureRecord`: the worker (rank, local rank), its agent (host,
  node rank, node key), what happened (``kind``: :data:`KIND_EXIT` with an
  exit code, :data:`KIND_SIGNAL` with a signal name, :data:`KIND_HUNG` for a
  worker that stopped making progress, or another short word a later
  version may add; ``detail`` says more in one line), its log and stack
  files, the round and restart it failed in, and the writer's wall-clock
  time, for people only (nothing decides on it);
* :func:`encode_failure` / :func:`decode_failure`: small, versioned JSON.
  Every string is cut to a named length on encoding, so an encoding is at
  most :data:`MAX_RECORD_BYTES`. The store is not trusted: a value that is
  too long, not JSON, of another version or with a field of the wrong type
  or length is a :class:`FailureRecordError` (never another exception);
* :func:`record_first`: the create-only write (``compare_set`` from absent)
  of the round's record in the round's store, which exactly one writer per
  round wins; :func:`publish_last` and :func:`read_last`: the run-level
  copy, outside every round's prefix, that outlives the re-formation the
  failure causes.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from rdzv.keys import first_failure_key, last_failure_key
from rdzv.store.base import Store

__all__ = [
    "KIND_EXIT",
    "KIND_HUNG",
    "KIND_SIGNAL",
    "MAX_RECORD_BYTES",
    "FailureRecord",
    "FailureRecordError",
    "cut",
    "decode_failure",
    "encode_failure",
    "json_record",
    "printable",
    "publish_last",
    "read_last",
    "record_first",
]

KIND_EXIT = "exit"
KIND_SIGNAL = "signal"
KIND_HUNG = "hung"

_VERSION = 1

#: Characters kept of each string field; longer ones are cut on encoding
#: and refused on decoding.
_LIMITS = {
    "kind": 16,
    "signal": 16,
    "host": 128,
    "node": 200,
    "detail": 400,
    "log": 512,
    "stack": 512,
}

#: The longest encoding a reader accepts (ASCII JSON: at most 6 bytes per
#: character of the capped strings, plus the numbers and names).
MAX_RECORD_BYTES = 16 * 1024

_INTS = ("rank", "local_rank", "group_rank", "exit_code", "round", "restart")
_INT_RANGE = range(-(1 << 31), 1 << 31)
_KIND = re.compile(r"[a-z][a-z0-9-]*")
# Terminal control characters (C0, DEL, C1) in text read from the store.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class FailureRecordError(ValueError):
    """A value in the store is not a first-failure record (the message says why)."""


@dataclass(frozen=True)
class FailureRecord:
    """One worker failure, as recorded for the whole job.

    Args:
        kind: What happened: :data:`KIND_EXIT`, :data:`KIND_SIGNAL`,
            :data:`KIND_HUNG` or another short lower-case word.
        rank: The worker's global rank.
        local_rank: Its rank on its node.
        host: The host name of its agent.
        time: When its agent saw it (seconds since the epoch, wall clock;
            for people only).
        exit_code: Its exit code, when it exited.
        signal: The name of the signal that killed it (``SIGKILL``), when one did.
        detail: More in one line: the exception ``@record`` recorded, or how it hung.
        log: Its log file.
        stack: A file with its stacks, when one was taken.
        group_rank: Its agent's rank in the round.
        node: Its agent's rendezvous node key.
        round: The rendezvous round it failed in, when known.
        restart: Restarts before the attempt it failed in.
    """

    kind: str
    rank: int
    local_rank: int
    host: str
    time: float
    exit_code: int | None = None
    signal: str | None = None
    detail: str | None = None
    log: str | None = None
    stack: str | None = None
    group_rank: int | None = None
    node: str | None = None
    round: int | None = None
    restart: int = 0

    def describe(self) -> str:
        """Return one line naming the worker, its host, what happened, when, and its files.

        Text read from a store has its terminal control characters escaped.
        """
        where = [f"local rank {self.local_rank}"]
        if self.group_rank is not None:
            where.insert(0, f"node {self.group_rank}")
        if self.kind == KIND_EXIT and self.exit_code is not None:
            what = f"exited with code {self.exit_code}"
        elif self.kind == KIND_SIGNAL and self.signal is not None:
            what = f"was killed by signal {self.signal}"
        else:
            what = self.kind
        attempt = f"restart {self.restart}"
        if self.round is not None:
            attempt = f"round {self.round}, {attempt}"
        when = time.strftime("%H:%M:%S", time.localtime(self.time))
        text = (
            f"worker rank {self.rank} on {self.host} ({', '.join(where)}) {what} "
            f"at {when} ({attempt})"
        )
        if self.detail:
            text += f": {self.detail}"
        if self.log:
            text += f"; log: {self.log}"
        if self.stack:
            text += f"; stacks: {self.stack}"
        return printable(text)


def printable(text: str) -> str:
    """Escape the terminal control characters of ``text``, read from a store."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def cut(text: str, limit: int) -> str:
    """Cut ``text`` to ``limit`` characters, ending with ``...`` when cut."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def encode_failure(record: FailureRecord) -> bytes:
    """Encode a record, its strings cut to their limits (at most :data:`MAX_RECORD_BYTES`)."""
    data: dict[str, Any] = {"v": _VERSION}
    for name, value in asdict(record).items():
        data[name] = cut(value, _LIMITS[name]) if isinstance(value, str) else value
    return json.dumps(data, separators=(",", ":")).encode("ascii")


def decode_failure(raw: bytes) -> FailureRecord:
    """Decode a record read from a store.

    Raises:
        FailureRecordError: It is too long, not JSON, of another version, or
            a field is missing, of the wrong type or too long.
    """
    data = json_record(raw, MAX_RECORD_BYTES, _VERSION, FailureRecordError)
    fields: dict[str, Any] = {}
    for name in FailureRecord.__dataclass_fields__:
        fields[name] = _field(data, name)
    if not _KIND.fullmatch(fields["kind"]):
        raise FailureRecordError(f"kind {fields['kind']!r} is not a lower-case word")
    return FailureRecord(**fields)


def json_record(raw: bytes, limit: int, version: int, error: type[ValueError]) -> dict[str, Any]:
    """Return the JSON object of a versioned record read from a store.

    Raises:
        ValueError: (``error``) It is over ``limit`` bytes, not JSON, not an
            object, or of another version than ``version``.
    """
    if len(raw) > limit:
        raise error(f"{len(raw)} bytes, over the limit of {limit}")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise error(f"not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise error("not a JSON object")
    if data.get("v") != version:
        raise error(f"version {data.get('v')!r}, not {version}")
    return data


def _field(data: Mapping[str, Any], name: str) -> Any:
    required = name in ("kind", "rank", "local_rank", "host", "time")
    value = data.get(name)
    if value is None:
        if required:
            raise FailureRecordError(f"{name} is missing")
        return 0 if name == "restart" else None
    if name in _LIMITS:
        if not isinstance(value, str) or len(value) > _LIMITS[name]:
            raise FailureRecordError(f"{name} is not a string of at most {_LIMITS[name]} chars")
    elif name in _INTS:
        if not isinstance(value, int) or isinstance(value, bool) or value not in _INT_RANGE:
            raise FailureRecordError(f"{name} is not a 32-bit integer")
    elif not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < 1e11:
        raise FailureRecordError(f"{name} is not a time in seconds since the epoch")
    return value


def record_first(round_store: Store, record: FailureRecord) -> bytes:
    """Create the round's first-failure record unless one exists; return the stored one.

    The stored record is ``encode_failure(record)`` exactly when this call
    created it.

    Raises:
        RendezvousError: The store cannot be written.
    """
    return round_store.compare_set(first_failure_key(), b"", encode_failure(record))


def publish_last(store: Store, run_id: str, raw: bytes) -> None:
    """Make an encoded record the run's last first failure (``store`` holds the rounds' stores).

    Raises:
        RendezvousError: The store cannot be written.
    """
    store.set(last_failure_key(run_id), raw)


def read_last(store: Store, run_id: str) -> FailureRecord | None:
    """Read the run's last first failure from its store (the one ``rdzv status`` reads).

    Raises:
        RendezvousError: The store cannot be read.
        FailureRecordError: The stored value is not a record.
    """
    raw = store.try_multi_get([last_failure_key(run_id)])[0]
    return None if raw is None else decode_failure(raw)
