"""Issue 42, item 2: a handler that cannot be created is an event, as on torch.

torch's ``create_handler`` records an rdzv event (``FAILED``, the message
``"<type>: <text>"``) when building the handler fails, and raises. rdzv's
logs the same event (``create-failed``) on its own event path, and under
torchrun torch records it too, with torch's message first.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch.distributed as torch_dist
from torch.distributed.elastic.rendezvous import api as torch_api
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as torch_dynamic

import rdzv
from rdzv import torchrun
from rdzv.dynamic.handler import create_handler
from rdzv.store.memory import HashStore
from rdzv.testing.memory import InMemoryBackend
from tests.torchcompat.helpers import raised
from tests.torchcompat.test_torch_backends import SilentBackend

BAD: dict[str, Any] = {"join_timeout": "0"}


def _torchs_event(torch_events: list[dict[str, Any]]) -> dict[str, Any]:
    """The event torch's own create_handler records for ``BAD``."""
    params = torch_api.RendezvousParameters("c10d", "h:1", "run", 1, 1, **BAD)
    store = torch_dist.HashStore()  # type: ignore[attr-defined]
    raised(lambda: torch_dynamic.create_handler(store, SilentBackend({}), params))
    [event] = torch_events
    torch_events.clear()
    return event


def test_rdzv_logs_the_failure_as_its_event_and_raises(caplog: pytest.LogCaptureFixture) -> None:
    params = rdzv.RendezvousParameters("c10d", "h:1", "run", 1, 1, **BAD)
    with caplog.at_level(logging.INFO, logger="rdzv.dynamic"):
        error = raised(lambda: create_handler(HashStore(), InMemoryBackend(), params))
    assert isinstance(error, ValueError)
    events = [r.rdzv_event for r in caplog.records if hasattr(r, "rdzv_event")]
    assert events == [
        {
            "run_id": "run",
            "round": -1,
            "node": None,
            "action": "create-failed",
            "error": f"ValueError: {error}",
        }
    ]


def test_only_torchrun_records_it_as_torchs_event(torch_events: list[dict[str, Any]]) -> None:
    params = rdzv.RendezvousParameters("c10d", "h:1", "run", 1, 1, **BAD)
    raised(lambda: create_handler(HashStore(), InMemoryBackend(), params))
    assert torch_events == []


def test_under_torchrun_torch_records_the_event_its_create_handler_records(
    torch_events: list[dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    torchs = _torchs_event(torch_events)
    params = torch_api.RendezvousParameters("rdzv", "127.0.0.1:1", "run", 1, 1, **BAD)
    with caplog.at_level(logging.INFO, logger="rdzv.dynamic"):
        raised(lambda: torchrun.create_rdzv_handler(params))
    [event] = torch_events
    assert (event["run_id"], event["node_state"]) == (torchs["run_id"], "FAILED")
    assert torchs["node_state"] == "FAILED"
    # torch's message first ("ValueError: The join timeout (0:00:00) must be positive."), then rdzv's detail.
    assert str(event["message"]).startswith(str(torchs["message"])), (event, torchs)
    assert event["pid"] == torchs["pid"]
    # ... and rdzv's own event path saw it.
    actions = [r.rdzv_event["action"] for r in caplog.records if hasattr(r, "rdzv_event")]
    assert actions == ["create-failed"]
