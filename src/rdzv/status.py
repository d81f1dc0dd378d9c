"""``rdzv status``: what a run's rendezvous looks like right now.

It reads the run's state through the backend (never joining, never hosting
a store): the last sealed round, whether it is closed, the participants in
rank order (with evicted ones marked), and the nodes queued for the next
round. Heartbeats are counters, not timestamps (rdzv never compares
machines' clocks), so a heartbeat's age is measured here: the marks are
sampled for a short window on this machine's monotonic clock, and the age
is the time since the mark was last seen to change (with ``--watch`` the
observation keeps running, so ages stay accurate over time).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rdzv.api import RendezvousParameters
from rdzv.backends.base import JoinQueueBackend, LivenessBackend, RendezvousBackend
from rdzv.dynamic.machine import MarkWatch
from rdzv.dynamic.state import RendezvousState, decode_record, decode_state, node_address
from rdzv.endpoint import parse_config
from rdzv.errors import RendezvousError
from rdzv.registry import open_backend as open_registered_backend

__all__ = [
    "HeartbeatTracker",
    "MemberStatus",
    "RunStatus",
    "add_status_arguments",
    "format_status",
    "open_backend",
    "read_status",
    "status_command",
]


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
    """

    rank: int
    node: str
    address: str
    evicted: bool
    heartbeat_age: float | None


@dataclass(frozen=True)
class RunStatus:
    """A run's rendezvous as read from its backend.

    Args:
        run_id: The run.
        round: The last sealed round (-1: none yet).
        closed: Whether the run is closed.
        members: The participants of that round, in rank order.
        waiting: Addresses of the nodes queued for the next round.
        observed_for: Seconds the heartbeats were watched.
    """

    run_id: str
    round: int
    closed: bool
    members: list[MemberStatus] = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)
    observed_for: float = 0.0

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

    It keeps the handler's own :class:`~rdzv.dynamic.machine.MarkWatch`
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
        """Record a reading of a node's mark.

        Args:
            node: The node key.
            mark: Its current mark (None: it has none).
        """
        seen = self._watches.get(node)
        if seen is not None and (seen.mark == mark or mark is None):
            return  # unchanged, or gone: the age keeps growing from the last change
        self._watches[node] = MarkWatch(mark, self._clock())
        if seen is not None:
            self._changed.add(node)

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
) -> tuple[RendezvousBackend, Callable[[], None]]:
    """Connect to a run's backend as an observer (never hosting a store).

    Any backend the registry knows works, plugins included (see
    :func:`rdzv.registry.open_backend`).

    Args:
        backend_name: The backend name (``c10d``, ...).
        endpoint: Its endpoint.
        run_id: The run.
        config: Backend settings (``read_timeout`` is 10 s unless given).

    Returns:
        The backend, and a function that closes its connections.

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

    return backend, close


def _state_of(backend: RendezvousBackend) -> RendezvousState | None:
    found = backend.get_state()
    return None if found is None else decode_state(found[0])


def _sample(backend: RendezvousBackend, nodes: list[str], tracker: HeartbeatTracker) -> None:
    if isinstance(backend, LivenessBackend):
        for node in nodes:
            tracker.observe(node, backend.heartbeat_mark(node))


def read_status(
    backend: RendezvousBackend,
    run_id: str,
    tracker: HeartbeatTracker,
    sample: float = 0.0,
    poll: float = 0.1,
    sleep: Callable[[float], None] = time.sleep,
) -> RunStatus:
    """Read a run's status, watching the heartbeats for ``sample`` seconds.

    Args:
        backend: The run's backend.
        run_id: The run.
        tracker: Keeps heartbeat observations (reuse it to watch over time).
        sample: Seconds to watch the heartbeats before answering.
        poll: Seconds between heartbeat readings while sampling.
        sleep: Sleeps between readings.

    Returns:
        The status.

    Raises:
        RendezvousError: The backend cannot be read or its state is corrupt.
    """
    state = _state_of(backend)
    if state is None:
        return RunStatus(run_id, -1, False, observed_for=tracker.observed_for)
    nodes = list(state.participants)
    _sample(backend, nodes, tracker)
    readings = max(int(sample / poll), 0) if poll > 0 else 0
    for _ in range(readings):
        sleep(poll)
        _sample(backend, nodes, tracker)
    waiting: list[str] = []
    if isinstance(backend, JoinQueueBackend):
        waiting = [
            node_address(decode_record(r).node) for r in backend.queue_records(state.next_round)
        ]
    members = [
        MemberStatus(
            rank,
            node,
            node_address(node),
            rank in state.evicted,
            tracker.age(node),
        )
        for rank, node in enumerate(state.participants)
    ]
    return RunStatus(run_id, state.round, state.closed, members, waiting, tracker.observed_for)


def format_status(status: RunStatus) -> str:
    """Render a status as a readable table.

    Args:
        status: The status.

    Returns:
        Lines of text, ending in a newline.
    """
    if not status.complete:
        head = f"run {status.run_id!r}: no round has completed yet"
    else:
        head = f"run {status.run_id!r}: round {status.round} complete"
    head += ", closed" if status.closed else ", open"
    lines = [head]
    if status.members:
        width = max(len(m.node) for m in status.members)
        lines.append(f"{'rank':>4}  {'node':<{width}}  {'state':<8} heartbeat")
        for m in status.members:
            if m.heartbeat_age is not None:
                beat = f"{m.heartbeat_age:.1f} s ago"
            else:
                beat = f"none seen in {status.observed_for:.1f} s"
            state = "evicted" if m.evicted else "member"
            lines.append(f"{m.rank:>4}  {m.node:<{width}}  {state:<8} {beat}")
    waiting = ", ".join(status.waiting) if status.waiting else "none"
    lines.append(f"waiting for round {status.round + 1}: {waiting}")
    return "\n".join(lines) + "\n"


def add_status_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``rdzv status`` to a parser.

    Args:
        parser: The ``status`` sub-parser.
    """
    parser.add_argument("--rdzv-backend", "--rdzv_backend", default="c10d", help="(c10d)")
    parser.add_argument("--rdzv-endpoint", "--rdzv_endpoint", required=True, help="host[:port]")
    parser.add_argument("--rdzv-id", "--rdzv_id", required=True, help="the run id")
    parser.add_argument("--rdzv-conf", "--rdzv_conf", default="", help="backend settings k=v,...")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--sample",
        type=float,
        default=2.0,
        help="seconds to watch heartbeats before answering (2)",
    )
    parser.add_argument(
        "--watch",
        type=float,
        nargs="?",
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="refresh every SECONDS (2) until interrupted",
    )


def status_command(args: argparse.Namespace) -> int:
    """Run ``rdzv status``.

    Args:
        args: The parsed options.

    Returns:
        0, 2 for bad options, 3 when the backend cannot be read.
    """
    if args.sample < 0 or (args.watch is not None and not args.watch > 0):
        print("rdzv status: error: --sample and --watch must be positive", file=sys.stderr)
        return 2
    try:
        backend, close = open_backend(
            args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id, parse_config(args.rdzv_conf)
        )
    except ValueError as exc:
        print(f"rdzv status: error: {exc}", file=sys.stderr)
        return 2
    except RendezvousError as exc:
        print(f"rdzv status: cannot reach the backend: {exc}", file=sys.stderr)
        return 3
    tracker = HeartbeatTracker()
    try:
        while True:
            sample = args.sample if args.watch is None else args.watch
            status = read_status(backend, args.rdzv_id, tracker, sample)
            if args.json:
                print(json.dumps(status.to_json(), sort_keys=True), flush=True)
            else:
                print(format_status(status), end="", flush=True)
            if args.watch is None:
                return 0
    except RendezvousError as exc:
        print(f"rdzv status: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        return 0
    finally:
        close()
