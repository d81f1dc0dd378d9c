"""The first failure of a round, recorded once for the whole job.

Theory of operation. When a worker fails, every agent of the job has
something to say: the one whose worker failed, and the others, whose
workers lose a peer or are stopped for the re-formation. What a person
needs is the cause, named once. So the agent that sees a failure records
it before it stops anything, with a create-only write (``compare_set``
from absent) of :func:`~rdzv.keys.first_failure_key` in the round's store:
across all agents exactly one record per round wins, and every loser gets
the winner back from the same call. The winner copies it to
:func:`~rdzv.keys.last_failure_key`, a run-level key outside every round's
prefix, so the record outlives the re-formation it causes: ``rdzv status``
shows it (:func:`read_last`) and the next rounds' agents can read it. The
winner writes both before it re-joins, so an agent that sees it waiting
to re-form finds the record already there.

The lines an agent writes about a restart or a re-form, and its last line,
end with ``after the first failure: ...`` (:meth:`FirstFailure.after`),
unless the failure they describe is that first failure itself.

"First" is the first recorded: the failure some agent saw first, which on
unsynchronised monitors is not always the one that happened first (a peer's
worker that dies of the lost connection may be seen sooner), and an agent
that dies whole records nothing (its peers' failures are recorded instead).

A record (:class:`FailureRecord`) is small, versioned JSON: every string is
cut to a named length and the encoding is at most :data:`MAX_RECORD_BYTES`.
The store is not trusted: a value that does not decode is a
:class:`FailureRecordError`, and readers ignore it with a note. The time
in a record is the writer's wall clock, for people only; nothing decides
on it. ``kind`` says what happened: :data:`KIND_EXIT` and
:data:`KIND_SIGNAL` for a worker that ended, :data:`KIND_HUNG` for one that
stopped making progress (its ``detail`` says how, ``stack`` where its
stacks went), or another short word a later version may add.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from rdzv.api import RendezvousInfo
from rdzv.errors import RendezvousError
from rdzv.keys import first_failure_key, last_failure_key, round_of_store
from rdzv.launch.workers import WorkerExit
from rdzv.store.base import Store
from rdzv.store.memory import PrefixStore

__all__ = [
    "KIND_EXIT",
    "KIND_HUNG",
    "KIND_SIGNAL",
    "MAX_RECORD_BYTES",
    "FailureRecord",
    "FailureRecordError",
    "FirstFailure",
    "decode_failure",
    "encode_failure",
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

    @classmethod
    def of_exit(
        cls,
        failure: WorkerExit,
        *,
        host: str,
        when: float,
        kind: str | None = None,
        detail: str | None = None,
        stack: str | None = None,
        group_rank: int | None = None,
        node: str | None = None,
        round: int | None = None,
        restart: int = 0,
    ) -> FailureRecord:
        """Describe a worker's exit (the other arguments are the fields of the same names).

        ``kind`` and ``detail`` default to what the exit tells: its code or
        signal, and the root cause ``@record`` left.
        """
        code = failure.returncode
        name = None
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
        return cls(
            kind or (KIND_SIGNAL if name else KIND_EXIT),
            failure.rank,
            failure.local_rank,
            host,
            when,
            code if code >= 0 else None,
            name,
            detail if detail is not None else failure.root_cause,
            None if failure.log_path is None else str(failure.log_path),
            stack,
            group_rank,
            node,
            round,
            restart,
        )

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
        return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def encode_failure(record: FailureRecord) -> bytes:
    """Encode a record, its strings cut to their limits (at most :data:`MAX_RECORD_BYTES`)."""
    data: dict[str, Any] = {"v": _VERSION}
    for name, value in asdict(record).items():
        data[name] = _cut(value, _LIMITS[name]) if isinstance(value, str) else value
    return json.dumps(data, separators=(",", ":")).encode("ascii")


def decode_failure(raw: bytes) -> FailureRecord:
    """Decode a record read from a store.

    Raises:
        FailureRecordError: It is too long, not JSON, of another version, or
            a field is missing, of the wrong type or too long.
    """
    if len(raw) > MAX_RECORD_BYTES:
        raise FailureRecordError(f"{len(raw)} bytes, over the limit of {MAX_RECORD_BYTES}")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise FailureRecordError(f"not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise FailureRecordError("not a JSON object")
    if data.get("v") != _VERSION:
        raise FailureRecordError(f"version {data.get('v')!r}, not {_VERSION}")
    fields: dict[str, Any] = {}
    for name in FailureRecord.__dataclass_fields__:
        fields[name] = _field(data, name)
    if not _KIND.fullmatch(fields["kind"]):
        raise FailureRecordError(f"kind {fields['kind']!r} is not a lower-case word")
    return FailureRecord(**fields)


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


def read_last(store: Store, run_id: str) -> FailureRecord | None:
    """Read the run's last first failure from its store (the one ``rdzv status`` reads).

    Raises:
        RendezvousError: The store cannot be read.
        FailureRecordError: The stored value is not a record.
    """
    raw = store.try_multi_get([last_failure_key(run_id)])[0]
    return None if raw is None else decode_failure(raw)


class FirstFailure:
    """One agent's side of the first failures of its rounds.

    Args:
        run_id: The run.
        node: This agent's rendezvous node key, if it has one.
        log: Receives the notes (a store that failed, a record that did not decode).
        host: This machine's name (``socket.gethostname()`` when None).
        clock: The wall clock of the records' times.
    """

    def __init__(
        self,
        run_id: str,
        node: str | None,
        log: Callable[[str], None],
        host: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._run_id = run_id
        self._node = node
        self._log = log
        self._host = host or socket.gethostname()
        self._clock = clock
        self._store: Store | None = None
        self._where: tuple[int, int | None, int] = (0, None, 0)
        self._first: FailureRecord | None = None
        self._found = False
        self._own = False

    def round_started(self, info: RendezvousInfo, group_rank: int, restart: int) -> None:
        """Follow the round whose workers this agent starts now."""
        self._store = info.store
        prefix = info.store.prefix if isinstance(info.store, PrefixStore) else ""
        self._where = (group_rank, round_of_store(self._run_id, prefix), restart)
        self._first, self._found, self._own = None, False, False

    def report(
        self,
        failure: WorkerExit,
        kind: str | None = None,
        detail: str | None = None,
        stack: str | None = None,
    ) -> FailureRecord | None:
        """Record a failure this agent saw, unless the round has its first; return the first.

        ``kind``, ``detail`` and ``stack`` override what the exit tells (a
        hung worker: :data:`KIND_HUNG`, how long it made no progress, where
        its stacks are). None when the store could not be used.
        """
        store = self._store
        if store is None or self._found:
            return self._first
        record = FailureRecord.of_exit(
            failure,
            host=self._host,
            when=self._clock(),
            kind=kind,
            detail=detail,
            stack=stack,
            group_rank=self._where[0],
            node=self._node,
            round=self._where[1],
            restart=self._where[2],
        )
        mine = encode_failure(record)
        try:
            stored = record_first(store, record)
            self._own = stored == mine
            if self._own:
                run_store = store.underlying_store if isinstance(store, PrefixStore) else store
                run_store.set(last_failure_key(self._run_id), mine)
        except RendezvousError as exc:
            self._log(f"could not record the first failure: {type(exc).__name__}: {exc}")
            return None
        self._found = True
        self._first = record if self._own else self._decoded(stored)
        return self._first

    def first(self) -> FailureRecord | None:
        """Return the first failure of the round this agent follows, or None (read once found)."""
        if self._found or self._store is None:
            return self._first
        try:
            raw = self._store.try_multi_get([first_failure_key()])[0]
        except RendezvousError as exc:
            self._log(f"could not read the first failure: {type(exc).__name__}: {exc}")
            return None
        if raw is not None:
            self._found = True
            self._first = self._decoded(raw)
        return self._first

    def after(self, text: str) -> str:
        """Return ``text`` naming the round's first failure, unless this agent's report was it."""
        first = self.first()
        if first is None or self._own:
            return text
        return f"{text} after the first failure: {first.describe()}"

    def say(self, text: str) -> None:
        """Log ``text`` naming the round's first failure (see :meth:`after`)."""
        self._log(self.after(text))

    def _decoded(self, raw: bytes) -> FailureRecord | None:
        try:
            return decode_failure(raw)
        except FailureRecordError as exc:
            self._log(f"ignoring the round's first-failure record, which does not decode: {exc}")
            return None
