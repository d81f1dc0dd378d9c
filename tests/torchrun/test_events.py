"""rdzv's rendezvous events reach torch's ``dynamic_rendezvous`` event handler under torchrun."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from rdzv import HashStore
from rdzv.dynamic.handler import DynamicRendezvousHandler
from rdzv.testing.memory import InMemoryBackend

pytest.importorskip("torch.distributed.elastic.events")
from torch.distributed.elastic.events import handlers as torch_handlers

from rdzv.torchrun.events import bridge_events

pytestmark = [pytest.mark.torch, pytest.mark.timeout(60)]


def _handler() -> DynamicRendezvousHandler:
    return DynamicRendezvousHandler.from_backend(
        "bridged", HashStore(), InMemoryBackend(), 1, 1, local_addr="127.0.0.1"
    )


def test_events_are_recorded_as_torchs_rendezvous_events(
    torch_events: list[dict[str, Any]],
) -> None:
    handler = _handler()
    rdzv_logger = logging.getLogger("rdzv.dynamic")
    level = rdzv_logger.level
    detach = bridge_events("bridged", handler.node)
    assert detach is not None
    try:
        handler.next_rendezvous()
        handler.shutdown()
    finally:
        detach()
        handler.close()
    assert rdzv_logger.level == level
    # torch prefixes the name with the file that recorded it, as for its own events
    names = [str(e["name"]).split(":", 1)[-1] for e in torch_events]
    assert names[:4] == ["rdzv.join", "rdzv.enqueue", "rdzv.sealed", "rdzv.complete"]
    complete = torch_events[names.index("rdzv.complete")]
    assert complete["run_id"] == "bridged"
    assert complete["node_state"] == "SUCCEEDED"
    assert complete["hostname"] == "127.0.0.1"
    assert complete["rank"] == 0
    assert json.loads(str(complete["message"]))["action"] == "complete"
    assert {e["run_id"] for e in torch_events} == {"bridged"}


def test_nothing_is_attached_while_torchs_handler_is_a_null_handler() -> None:
    assert isinstance(torch_handlers.get_logging_handler("dynamic_rendezvous"), logging.NullHandler)
    assert bridge_events("bridged", "127.0.0.1#1#a") is None
