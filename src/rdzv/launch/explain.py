"""Lines that name nodes: who left or waits when the group changes, who came before a timeout.

The dynamic rendezvous keeps its state in the backend; these helpers read it
as an observer (as ``rdzv status`` does) to turn "the group changed" into
node keys. Everything here is best effort: a backend that cannot be read
gives the plain message, never an error.
"""

from __future__ import annotations

from rdzv.api import RendezvousHandler
from rdzv.backends.base import JoinQueueBackend, ListedBackend
from rdzv.dynamic.handler import DynamicRendezvousHandler
from rdzv.dynamic.state import decode_record, decode_state

__all__ = ["describe_change", "describe_timeout"]

_SHOWN = 8


def _names(nodes: list[str]) -> str:
    shown = ", ".join(nodes[:_SHOWN])
    return shown if len(nodes) <= _SHOWN else f"{shown} and {len(nodes) - _SHOWN} more"


def describe_change(handler: RendezvousHandler, waiting: int) -> str:
    """Say how the group changed: members evicted (dead or left), nodes waiting to join.

    Args:
        handler: The handler; only the dynamic rendezvous can say more.
        waiting: What ``num_nodes_waiting()`` answered.

    Returns:
        A phrase such as ``member 10.0.0.3#77#ab left or missed its
        heartbeats; 10.0.0.4#12#cd waits to join``.
    """
    plain = f"{waiting} node(s) waiting or a member left"
    if not isinstance(handler, DynamicRendezvousHandler):
        return plain
    backend = handler.backend
    try:
        found = backend.get_state()
        if found is None:
            return f"{plain} (the rendezvous state is gone: the store lost it?)"
        state = decode_state(found[0])
        gone = [n for i, n in enumerate(state.participants) if i in state.evicted]
        queued: list[str] = []
        if isinstance(backend, JoinQueueBackend):
            queued = [decode_record(r).node for r in backend.queue_records(state.next_round)]
    except Exception:  # noqa: BLE001 - an explanation must never fail the agent
        return plain
    parts = []
    if gone:
        parts.append(f"member(s) {_names(gone)} left or missed their heartbeats")
    if queued:
        parts.append(f"{_names(queued)} wait(s) to join round {state.next_round}")
    if handler.node not in state.participants:
        parts.append(f"a newer round {state.round} formed without this node")
    return "; ".join(parts) or plain


def describe_timeout(handler: RendezvousHandler) -> str:
    """Say who came before a join timeout, and which other runs the store holds (or ``""``)."""
    if not isinstance(handler, DynamicRendezvousHandler):
        return ""
    backend = handler.backend
    run_id = handler.get_run_id()
    parts = []
    try:
        found = backend.get_state()
        next_round = 0 if found is None else decode_state(found[0]).next_round
        if isinstance(backend, JoinQueueBackend):
            came = [decode_record(r).node for r in backend.queue_records(next_round)]
            others = [n for n in came if n != handler.node]
            parts.append(f"nodes that came: {_names(others) if others else 'none but this one'}")
        if isinstance(backend, ListedBackend):
            runs = [r for r in backend.runs() if r != run_id]
            if runs:
                parts.append(f"other runs on this store: {_names([repr(r) for r in runs])}")
    except Exception:  # noqa: BLE001 - an explanation must never fail the agent
        return ""
    return "; ".join(parts)
