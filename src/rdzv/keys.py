"""Where a run's keys live in a store: every key root, written once.

One store may hold several runs, each written by several parts of rdzv under
their own root:

* ``rdzv.backend/<run>/``: the c10d backend (:mod:`rdzv.backends.store`),
  its state, queues, heartbeats and seats;
* ``rdzv.handler/<run>/``: the dynamic handler, its sealed rounds,
  confirmations and departures, and queues and heartbeats when the backend
  lacks them;
* ``rdzv/<run>/round/<r>``: the store handed to the agents of round ``r``,
  where ``rdzv run`` writes under ``rdzv.launch/`` (torch's agent writes
  there too);
* ``rdzv.static/<run>/``: the static rendezvous.

Under a backend or handler root, the capabilities over a store
(:mod:`rdzv.backends.kv`) keep a queue at ``<kind>/<round>`` with its
counter at ``<kind>/<round>/n``, and a node's heartbeat at ``hb/<node>``.
"""

from __future__ import annotations

import re

__all__ = [
    "CONFIRM_QUEUE",
    "JOIN_QUEUE",
    "LAUNCH_ROOT",
    "STATIC_ROOT",
    "agent_key",
    "backend_prefix",
    "handler_prefix",
    "heartbeat_key",
    "queue_keys",
    "round_store_prefix",
    "run_of_backend_key",
]

LAUNCH_ROOT = "rdzv.launch"
STATIC_ROOT = "rdzv.static"
JOIN_QUEUE = "q"
CONFIRM_QUEUE = "c"
_BACKEND_ROOT = "rdzv.backend"
_HEARTBEAT = "hb"

# The keys that mark a run in the c10d backend: its state, join queues, heartbeats.
_BACKEND_KEY = re.compile(
    rf"{re.escape(_BACKEND_ROOT)}/(.+)/"
    rf"(?:state|{JOIN_QUEUE}/\d+(?:/n)?|{_HEARTBEAT}/[^/]+)"
)


def backend_prefix(run_id: str) -> str:
    """Return the c10d backend's key prefix for a run (ends with ``/``)."""
    return f"{_BACKEND_ROOT}/{run_id}/"


def handler_prefix(run_id: str) -> str:
    """Return the dynamic handler's key prefix for a run (ends with ``/``)."""
    return f"rdzv.handler/{run_id}/"


def round_store_prefix(run_id: str, round_id: int) -> str:
    """Return the prefix of the store handed to the agents of a round."""
    return f"rdzv/{run_id}/round/{round_id}"


def queue_keys(prefix: str, kind: str, round_id: int) -> tuple[str, str]:
    """Return a round's queue key and its counter's key under a prefix."""
    base = f"{prefix}{kind}/{round_id}"
    return base, f"{base}/n"


def heartbeat_key(prefix: str, node: str) -> str:
    """Return the key of a node's heartbeat counter under a prefix."""
    return f"{prefix}{_HEARTBEAT}/{node}"


def agent_key(group_rank: int) -> str:
    """Return the key of the round's store where an agent says how it runs.

    The value is JSON: ``{"host": ..., "workers": N, "restarts": N}``, written
    when the agent starts its workers; ``rdzv status`` shows it.

    Args:
        group_rank: The agent's node rank in the round.

    Returns:
        The key, relative to the round's store.
    """
    return f"{LAUNCH_ROOT}/agent/{group_rank}"


def run_of_backend_key(key: str) -> str | None:
    """Return the run a c10d backend key belongs to, or None for any other key."""
    match = _BACKEND_KEY.fullmatch(key)
    return None if match is None else match.group(1)
