"""rdzv's rendezvous events as torch's elastic rendezvous events, under torchrun.

torch's own dynamic rendezvous records an event for each step through
``torch.distributed.elastic.events.construct_and_record_rdzv_event``, which
goes to torch's ``dynamic_rendezvous`` event handler (a ``NullHandler``
unless a deployment installed one). :class:`TorchEventBridge` listens to the
structured events of rdzv's dynamic handler (the ``rdzv_event`` of the
``rdzv.dynamic`` logger's records) and records each as torch's event of the
same run, with the node's address, pid, rank and the event's fields as
JSON in the message. It is attached only when torch's handler is not a
``NullHandler``, so by default it costs nothing.

A handler that cannot be created has no node key yet: its ``create-failed``
event (:func:`rdzv.dynamic.handler.create_handler`) reaches torch through
:func:`bridged_creation`, which the torchrun creators open around creating
one, as torch's ``create_handler`` event: its message is torch's
``"<type>: <text>"``, its state ``FAILED``.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator, Mapping

__all__ = ["TorchEventBridge", "bridge_events", "bridged_creation"]

_EVENTS_LOGGER = "rdzv.dynamic"


class TorchEventBridge(logging.Handler):
    """Records one node's rdzv events as torch's rendezvous events.

    Args:
        run_id: Only this run's events are recorded.
        node: Only this node key's events are recorded (None: the events
            of a handler being created, which has none yet).
    """

    def __init__(self, run_id: str, node: str | None) -> None:
        super().__init__(logging.NOTSET)
        self._run_id = run_id
        self._node = node

    def emit(self, record: logging.LogRecord) -> None:
        """Record the record's event when it is this node's."""
        event = getattr(record, "rdzv_event", None)
        if not isinstance(event, Mapping):
            return
        if event.get("run_id") != self._run_id or event.get("node") != self._node:
            return
        try:
            from torch.distributed.elastic.events import (  # noqa: PLC0415 - torch is optional
                construct_and_record_rdzv_event,
            )
            from torch.distributed.elastic.events.api import (  # noqa: PLC0415 - torch is optional
                NodeState,
            )

            action = str(event.get("action"))
            if action in ("fail", "broken", "create-failed"):
                state = NodeState.FAILED
            elif action in ("complete", "closed", "shutdown"):
                state = NodeState.SUCCEEDED
            elif action in ("join", "enqueue", "requeue", "waiting"):
                state = NodeState.INIT
            else:
                state = NodeState.RUNNING
            address, pid, _ = [*(self._node or "").split("#"), "", ""][:3]
            rank = event.get("rank")
            message = (
                str(event.get("error"))
                if action == "create-failed"
                else json.dumps(event, sort_keys=True, default=str)
            )
            construct_and_record_rdzv_event(
                run_id=self._run_id,
                message=message,
                node_state=state,
                name=f"rdzv.{action}",
                hostname=address,
                pid=int(pid) if pid.isdigit() else None,
                rank=rank if isinstance(rank, int) else None,
            )
        except Exception:  # noqa: BLE001 - logging must never raise into the caller
            self.handleError(record)


def bridge_events(run_id: str, node: str | None) -> Callable[[], None] | None:
    """Forward a node's rdzv events to torch's rendezvous event handler, if it has one.

    Args:
        run_id: The run.
        node: The node key of the rdzv handler (None: of one being created).

    Returns:
        A function that stops forwarding, or None when torch's
        ``dynamic_rendezvous`` handler is a ``NullHandler`` (nothing to do).
    """
    from torch.distributed.elastic.events.handlers import (  # noqa: PLC0415 - torch is optional
        get_logging_handler,
    )

    if isinstance(get_logging_handler("dynamic_rendezvous"), logging.NullHandler):
        return None
    bridge = TorchEventBridge(run_id, node)
    logger = logging.getLogger(_EVENTS_LOGGER)
    previous = logger.level
    logger.addHandler(bridge)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)

    def detach() -> None:
        logger.removeHandler(bridge)
        logger.setLevel(previous)

    return detach


@contextlib.contextmanager
def bridged_creation(run_id: str) -> Iterator[None]:
    """Forward the events of a handler of ``run_id`` being created while the block runs."""
    detach = bridge_events(run_id, None)
    try:
        yield
    finally:
        if detach is not None:
            detach()
