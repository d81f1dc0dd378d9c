"""The dynamic rendezvous's structured events, logged on ``rdzv.dynamic``.

Each event is one INFO record whose ``rdzv_event`` attribute is the event
itself (``run_id``, ``round``, ``node``, ``action`` and the action's
fields); its text, the event as JSON, is built only when a log handler
formats the record.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from typing import Any

__all__ = ["LOGGER", "log_event", "recorded_creation"]

LOGGER = logging.getLogger("rdzv.dynamic")


class _EventText:
    """An event's JSON text, built only when a log handler formats the record.

    The handlers that read the event itself (``rdzv run``'s progress, the
    torchrun bridge) never pay for it; a member of thousands logs four
    events per round.
    """

    __slots__ = ("_event",)

    def __init__(self, event: dict[str, Any]) -> None:
        self._event = event

    def __str__(self) -> str:
        return json.dumps(self._event, sort_keys=True)


def log_event(
    run_id: str, round_id: int, node: str | None, action: str, fields: dict[str, Any]
) -> None:
    """Log one structured event on :data:`LOGGER` (the record's ``rdzv_event``)."""
    event = {"run_id": run_id, "round": round_id, "node": node, "action": action, **fields}
    LOGGER.info("rdzv %s", _EventText(event), extra={"rdzv_event": event})


@contextlib.contextmanager
def recorded_creation(run_id: str) -> Iterator[None]:
    """Log a failure of the block, creating a handler of ``run_id``, as ``create-failed``; raise it.

    The event has round -1, no node key (there is none yet) and ``error``:
    ``"<type>: <text>"``, the message of torch's event for the same failure.
    """
    try:
        yield
    except Exception as exc:
        if LOGGER.isEnabledFor(logging.INFO):
            error = f"{type(exc).__name__}: {exc}"
            log_event(run_id, -1, None, "create-failed", {"error": error})
        raise
