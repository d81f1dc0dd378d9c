"""``rdzv status``: what a run's rendezvous looks like right now.

It reads the run's state through the backend (never joining, never hosting
a store): the last sealed round, whether it is closed, the participants in
rank order (with evicted ones marked), and the nodes queued for the next
round. Heartbeats are counters, not timestamps (rdzv never compares
machines' clocks), so a heartbeat's age is measured here: the marks are
sampled for a short window on this machine's monotonic clock, and the age
is the time since the mark was last seen to change (with ``--watch`` the
observation keeps running, so ages stay accurate over time).

Before the first round completes there is no state, but nodes may already
be queued for round 0: they are shown. A run with neither is unknown
(the command, :mod:`rdzv.status_cli`, then lists the runs the store holds;
``--list-runs`` lists them with their rounds). Each agent of ``rdzv run``
writes its host, worker count and restart count into the round's store;
the table shows them when present, and a line names the run's last first
failure (:mod:`rdzv.first_failure`) when one was recorded.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rdzv.api import RendezvousParameters
from rdzv.backends.base import (
    GONE_MARK,
    JoinQueueBackend,
    LivenessBackend,
    RendezvousBackend,
)
from rdzv.dynamic.judging import MarkWatch
from rdzv.dynamic.state import (
    JoinRecord,
    RendezvousState,
    decode_record,
    decode_state,
    node_address,
)
from rdzv.exclusion import ExclusionRecord, read_current
from rdzv.first_failure import FailureRecord, FailureRecordError, printable, read_last
from rdzv.keys import agent_key, round_store_prefix, runs_of
from rdzv.registry import open_backend as open_registered_backend
from rdzv.store.base import Store
from rdzv.store.foreign import StoreLike, as_store
from rdzv.store.memory import PrefixStore

__all__ = [
    "HeartbeatTracker",
    "MemberStatus",
    "RunStatus",
    "format_status",
    "list_runs",
    "open_backend",
    "read_status",
]


# Terminal control characters (C0, DEL, C1) in names read from the store.
@dataclass(frozen=True)
class MemberStatus:
    """One participant of the last sealed round.

    Args:
        rank: Its rank in the round.
        node: Its node key.
        address: Its address.
        evicted: Removed since the round sealed (dead or departed).
        heartbeat_age: Seconds since its heartbeat mark was seen to change,
            or None when no change was seen.
        host: The host name its agent reported (``rdzv run``), or None.
        workers: The workers its agent started, or None when not reported.
        restarts: Its agent's restarts after worker failures, or None.
        gone: Its mark says its process died (the store wrote its will).
    """

    rank: int
    node: str
    address: str
    evicted: bool
    heartbeat_age: float | None
    host: str | None = None
    workers: int | None = None
    restarts: int | None = None
    gone: bool = False


@dataclass(frozen=True)
class RunStatus:
    """A run's rendezvous as read from its backend.

    Args:
        run_id: The run.
        round: The last sealed round (-1: none yet).
        closed: Whether the run is closed.
        members: The participants of that round, in rank order.
        waiting: The node keys of the nodes queued for the next round.
        observed_for: Seconds the heartbeats were watched.
        time: When it was read (seconds since the epoch).
        known: Whether the backend holds anything of the run (a state or
            a queued node).
        first_failure: The run's last first failure, when one was recorded.
        failure_note: Why a stored first-failure record was ignored, if one was.
        excluded: The nodes excluded now, or failing now (:mod:`rdzv.exclusion`).
        exclusion_notes: Why stored exclusion records were ignored.
        target_nodes: The run's target size, when ``--rdzv-conf`` names it.
        waiting_keys: The rank-order key value each waiting node published
            (``rank_order_key``), for those that published one.
    """

    run_id: str
    round: int
    closed: bool
    members: list[MemberStatus] = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)
    observed_for: float = 0.0
    time: float = 0.0
    known: bool = True
    first_failure: FailureRecord | None = None
    failure_note: str | None = None
    excluded: list[ExclusionRecord] = field(default_factory=list)
    exclusion_notes: list[str] = field(default_factory=list)
    target_nodes: int | None = None
    waiting_keys: dict[str, str] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        """Whether a round has sealed."""
        return self.round >= 0

    def to_json(self) -> dict[str, Any]:
        """Return the status as plain JSON-able data."""
        data = dataclasses.asdict(self)
        data["complete"] = self.complete
        return data


class HeartbeatTracker:
    """Remembers when each node's heartbeat mark last changed, on a monotonic clock.

    It keeps the handler's own :class:`~rdzv.dynamic.judging.MarkWatch`
    records, so an age here means what the handler's judgement means: time
    on this observer's clock since the mark was first seen with its current
    value. A node whose mark was never seen to change has no age.

    Args:
        clock: The clock (``time.monotonic`` by default).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._started = clock()
        self._watches: dict[str, MarkWatch] = {}
        self._changed: set[str] = set()

    def observe(self, node: str, mark: bytes | None) -> None:
        """Record a reading of a node's mark (None: it has none)."""
        seen = self._watches.get(node)
        if seen is not None and (seen.mark == mark or mark is None):
            return  # unchanged, or gone: the age keeps growing from the last change
        self._watches[node] = MarkWatch(mark, self._clock())
        if seen is not None:
            self._changed.add(node)

    def gone(self, node: str) -> bool:
        """Tell whether the node's last mark says its process died (:data:`GONE_MARK`)."""
        seen = self._watches.get(node)
        return seen is not None and seen.mark == GONE_MARK

    def age(self, node: str) -> float | None:
        """Return seconds since the node's mark was seen to change, or None."""
        if node not in self._changed:
            return None
        return self._clock() - self._watches[node].since

    @property
    def observed_for(self) -> float:
        """Seconds since the tracker started."""
        return self._clock() - self._started


def open_backend(
    backend_name: str, endpoint: str, run_id: str, config: dict[str, str] | None = None
) -> tuple[RendezvousBackend, Store, Callable[[], None]]:
    """Connect to a run's backend as an observer (never hosting a store).

    Any backend the registry knows works, plugins included (see
    :func:`rdzv.registry.open_backend`).

    Args:
        backend_name: The backend name (``c10d``, ...).
        endpoint: Its endpoint.
        run_id: The run.
        config: Backend settings (``read_timeout`` is 10 s unless given).

    Returns the backend, the store its rounds' stores are prefixes of, and
    a function that closes both.

    Raises:
        ValueError: The backend is unknown or its state cannot be read.
        RendezvousConnectionError: The backend could not be reached.
    """
    params = RendezvousParameters(
        backend_name,
        endpoint,
        run_id,
        config={"read_timeout": "10", **(config or {}), "is_host": "false"},
    )
    backend, store = open_registered_backend(params)

    def close() -> None:
        try:
            backend.close()
        finally:
            store.close()

    return backend, store, close


def _state_of(backend: RendezvousBackend) -> RendezvousState | None:
    found = backend.get_state()
    return None if found is None else decode_state(found[0])


def _sample(backend: RendezvousBackend, nodes: list[str], tracker: HeartbeatTracker) -> None:
    if isinstance(backend, LivenessBackend):
        for node in nodes:
            tracker.observe(node, backend.heartbeat_mark(node))


def _queued(backend: RendezvousBackend, round_id: int) -> list[str]:
    return [r.node for r in _queued_records(backend, round_id)]


def _queued_records(backend: RendezvousBackend, round_id: int) -> list[JoinRecord]:
    if not isinstance(backend, JoinQueueBackend):
        return []
    return [decode_record(r) for r in backend.queue_records(round_id)]


def _agents(store: Store | None, run_id: str, state: RendezvousState) -> list[dict[str, Any]]:
    """Read what each member's agent wrote into the round's store (``{}`` when nothing)."""
    if store is None or not state.participants:
        return [{} for _ in state.participants]
    round_store = PrefixStore(round_store_prefix(run_id, state.round), store)
    keys = [agent_key(rank) for rank in range(len(state.participants))]
    found: list[dict[str, Any]] = []
    for raw in round_store.try_multi_get(keys):
        try:
            record = json.loads(raw) if raw is not None else {}
        except ValueError:
            record = {}
        found.append(record if isinstance(record, dict) else {})
    return found


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def list_runs(store: StoreLike) -> list[str]:
    """Return the run ids the store backend (``c10d``, ...) holds keys of, sorted.

    ``store`` is the rendezvous store, not a prefix of it (an rdzv store or
    one with torch's ``Store`` API).

    Raises:
        RendezvousError: The store cannot be read.
    """
    return runs_of(as_store(store).list_keys())


def read_status(
    backend: RendezvousBackend,
    run_id: str,
    tracker: HeartbeatTracker,
    sample: float = 0.0,
    poll: float = 0.1,
    sleep: Callable[[float], None] = time.sleep,
    store: StoreLike | None = None,
) -> RunStatus:
    """Read a run's status, watching the heartbeats for ``sample`` seconds.

    While sampling, the state is read again at every reading: a change of
    round, or the run closing, ends the sample early.

    Args:
        backend: The run's backend.
        run_id: The run.
        tracker: Keeps heartbeat observations (reuse it to watch over time).
        sample: Seconds to watch the heartbeats before answering.
        poll: Seconds between heartbeat readings while sampling.
        sleep: Sleeps between readings.
        store: The run's store, to read what the agents wrote (host,
            workers, restarts): an rdzv store or one with torch's ``Store``
            API; None to skip it.

    Raises:
        RendezvousError: The backend cannot be read or its state is corrupt.
    """
    state = _state_of(backend)
    now = time.time()
    run_store = None if store is None else as_store(store)
    excluded, notes = ([], []) if run_store is None else read_current(run_store, run_id, now)
    if state is None:
        queued = _queued(backend, 0)
        return RunStatus(
            run_id,
            -1,
            False,
            waiting=queued,
            observed_for=tracker.observed_for,
            time=now,
            known=bool(queued or excluded),
            excluded=excluded,
            exclusion_notes=notes,
        )
    nodes = list(state.participants)
    _sample(backend, nodes, tracker)
    readings = max(int(sample / poll), 0) if poll > 0 else 0
    for _ in range(readings):
        sleep(poll)
        _sample(backend, nodes, tracker)
        latest = _state_of(backend)
        if latest is not None and (latest.round, latest.closed) != (state.round, state.closed):
            state = latest
            break
    agents = _agents(run_store, run_id, state)
    failure, note = None, None
    try:
        failure = None if run_store is None else read_last(run_store, run_id)
    except FailureRecordError as exc:
        note = f"the stored record does not decode and was ignored ({exc})"
    members = [
        MemberStatus(
            rank,
            node,
            node_address(node),
            rank in state.evicted,
            tracker.age(node),
            agent.get("host") if isinstance(agent.get("host"), str) else None,
            _int_or_none(agent.get("workers")),
            _int_or_none(agent.get("restarts")),
            tracker.gone(node),
        )
        for (rank, node), agent in zip(enumerate(state.participants), agents, strict=True)
    ]
    records = _queued_records(backend, state.next_round)
    return RunStatus(
        run_id,
        state.round,
        state.closed,
        members,
        [r.node for r in records],
        tracker.observed_for,
        now,
        first_failure=failure,
        failure_note=note,
        excluded=excluded,
        exclusion_notes=notes,
        waiting_keys={r.node: r.topology for r in records if r.topology},
    )


def _stamp(when: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when))


def format_status(status: RunStatus) -> str:
    """Render a status as a readable table.

    Names read from the store (run id, node keys, hosts) have their
    terminal control characters escaped.
    """
    run = printable(repr(status.run_id))
    if not status.complete:
        head = f"run {run}: no round has completed yet"
    else:
        head = f"run {run}: round {status.round} complete"
    head += ", closed" if status.closed else ", open"
    lines = [f"{_stamp(status.time)} {head}" if status.time else head]
    if status.members:
        rows = []
        for m in status.members:
            if m.gone:
                beat = "process gone"
            elif m.heartbeat_age is not None:
                beat = f"{m.heartbeat_age:.1f} s ago"
            else:
                beat = f"none seen in {status.observed_for:.1f} s"
            rows.append(
                (
                    f"{m.rank:>4}",
                    printable(m.node),
                    "evicted" if m.evicted else "member",
                    beat,
                    "-" if m.workers is None else str(m.workers),
                    "-" if m.restarts is None else str(m.restarts),
                    "-" if m.host is None else printable(m.host),
                )
            )
        header = ("rank", "node", "state", "heartbeat", "workers", "restarts", "host")
        reported = any(m.workers is not None for m in status.members)
        columns = len(header) if reported else 4
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(columns)]
        for row in [header, *rows]:
            cells = [
                row[0].rjust(widths[0]),
                *(cell.ljust(widths[i + 1]) for i, cell in enumerate(row[1:columns])),
            ]
            lines.append("  ".join(cells).rstrip())
    waiting = ", ".join(
        printable(w + (f" ({status.waiting_keys[w]})" if w in status.waiting_keys else ""))
        for w in status.waiting
    )
    if status.target_nodes is not None:
        waiting = f"{len(status.waiting)} of target {status.target_nodes}: {waiting or 'none'}"
    lines.append(f"waiting for round {status.round + 1}: {waiting or 'none'}")
    if status.first_failure is not None or status.failure_note is not None:
        first = status.first_failure
        shown = first.describe() if first else status.failure_note
        lines.append(printable(f"first failure: {shown}"))
    lines.extend(f"node {record.describe(status.time)}" for record in status.excluded)
    lines.extend(printable(note) for note in status.exclusion_notes)
    return "\n".join(lines) + "\n"
