"""Where a run's keys live in a store: every key root, written once.

One store may hold several runs, each under these roots:

* ``rdzv.backend/<run>/``: the c10d backend's state, queues, heartbeats, seats;
* ``rdzv.handler/<run>/``: the dynamic handler's sealed rounds, confirmations
  and departures, and its queues and heartbeats when the backend lacks them;
* ``rdzv/<run>/round/<r>``: the store of round ``r``'s agents (``rdzv run``
  writes under ``rdzv.launch/`` there, and torch's agent writes there too);
* ``rdzv.launch/<run>/``: what ``rdzv run`` keeps for the whole run, beside
  the rounds' stores (the last first failure, which outlives its round, and
  the nodes' exclusion records);
* ``rdzv.static/<run>/``: the static rendezvous.

Under the first two live the keys of the functions below: queues,
heartbeats, verdicts, the c10d backend's state and seats, sealed rounds
and the first member to leave each.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

LAUNCH_ROOT = "rdzv.launch"
STATIC_ROOT = "rdzv.static"
JOIN_QUEUE = "q"
CONFIRM_QUEUE = "c"
_BACKEND_ROOT = "rdzv.backend"
_HEARTBEAT = "hb"
_STATE = "state"
# The keys that mark a run in the c10d backend: its state, join queues, heartbeats.
_BACKEND_MARK = re.compile(
    rf"{re.escape(_BACKEND_ROOT)}/(.+)/(?:{_STATE}|{JOIN_QUEUE}/\d+(?:/n)?|{_HEARTBEAT}/[^/]+)"
)


def backend_prefix(run_id: str) -> str:
    """Return the c10d backend's key prefix for a run (ends with ``/``)."""
    return f"{_BACKEND_ROOT}/{run_id}/"


def handler_prefix(run_id: str) -> str:
    """Return the dynamic handler's key prefix for a run (ends with ``/``)."""
    return f"rdzv.handler/{run_id}/"


def static_prefix(run_id: str) -> str:
    """Return the static rendezvous's key prefix for a run (ends with ``/``)."""
    return f"{STATIC_ROOT}/{run_id}/"


def round_store_prefix(run_id: str, round_id: int) -> str:
    """Return the prefix of the store handed to the agents of a round."""
    return f"rdzv/{run_id}/round/{round_id}"


def queue_keys(prefix: str, kind: str, round_id: int) -> tuple[str, str]:
    """Return a round's queue key and its counter's key under a prefix."""
    base = f"{prefix}{kind}/{round_id}"
    return base, f"{base}/n"


def verdict_key(prefix: str, round_id: int) -> str:
    """Return the key that exists once every member of a round confirmed it, under a prefix."""
    return f"{prefix}confirm/{round_id}/verdict"


def state_key(prefix: str) -> str:
    """Return the key of the c10d backend's state (its head) under a prefix."""
    return f"{prefix}{_STATE}"


def seat_key(prefix: str, node: str) -> str:
    """Return the key of a node's seat in the c10d backend under a prefix."""
    return f"{prefix}seat/{node}"


def round_key(prefix: str, round_id: int) -> str:
    """Return the key holding a round as sealed, for members that ask for its participants."""
    return f"{prefix}round/{round_id}"


def leave_key(prefix: str, round_id: int) -> str:
    """Return the key naming the member that left a round first."""
    return f"{prefix}leave/{round_id}"


def heartbeat_key(prefix: str, node: str) -> str:
    """Return the key of a node's heartbeat counter under a prefix."""
    return f"{prefix}{_HEARTBEAT}/{node}"


def agent_key(group_rank: int) -> str:
    """Return the round-store key of an agent's JSON ``host``, ``workers`` and ``restarts``."""
    return f"{LAUNCH_ROOT}/agent/{group_rank}"


def first_failure_key() -> str:
    """Return the round-store key of the round's first worker failure (created once)."""
    return f"{LAUNCH_ROOT}/first-failure"


def last_failure_key(run_id: str) -> str:
    """Return the key, outside every round's store, of the run's last first failure."""
    return f"{LAUNCH_ROOT}/{run_id}/first-failure"


def exclusion_key(run_id: str, node: str) -> str:
    """Return the key, outside every round's store, of a node's exclusion record."""
    return f"{LAUNCH_ROOT}/{run_id}/exclusion/{node}"


def exclusion_index_key(run_id: str) -> str:
    """Return the key of the run's list of nodes with an exclusion record (one per line)."""
    return f"{LAUNCH_ROOT}/{run_id}/exclusions"


def round_of_store(run_id: str, prefix: str) -> int | None:
    """Return the round whose store has ``prefix`` (see :func:`round_store_prefix`), or None."""
    head = round_store_prefix(run_id, 0)[:-1]
    tail = prefix[len(head) :] if prefix.startswith(head) else ""
    return int(tail) if tail.isascii() and tail.isdigit() else None


def runs_of(keys: Iterable[str]) -> list[str]:
    """Return the runs the keys of a store name in the c10d backend, sorted."""
    return sorted({run for run in map(run_of_backend_key, keys) if run is not None})


def run_of_backend_key(key: str) -> str | None:
    """Return the run a c10d backend key marks, or None for any other key."""
    match = _BACKEND_MARK.fullmatch(key)
    return None if match is None else match.group(1)
