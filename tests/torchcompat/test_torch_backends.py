"""Issue 42, item 3: a backend written against torch's ``RendezvousBackend``.

torch documents a backend as ``name``, ``get_state`` and ``set_state``, and
its handler tolerates a ``set_state`` that returns None after writing (it
reads the state at its next sync). A two-node round over such a backend, in
memory, completes on torch's handler and on rdzv's, over torch's store and
over rdzv's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as torch_dist
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as torch_dynamic

import rdzv
from rdzv.store.memory import HashStore

pytestmark = pytest.mark.timeout(90)


class SilentBackend(torch_dynamic.RendezvousBackend):
    """An in-memory backend that answers a write it made with None, as torch allows."""

    def __init__(self, shared: dict[str, Any]) -> None:
        self._shared = shared

    @property
    def name(self) -> str:
        return "silent"

    def get_state(self) -> tuple[bytes, Any] | None:
        with self._shared["lock"]:
            record: tuple[int, bytes] | None = self._shared.get("record")
            return None if record is None else (record[1], record[0])

    def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Any, bool] | None:
        with self._shared["lock"]:
            record: tuple[int, bytes] | None = self._shared.get("record")
            current = None if record is None else record[0]
            if token != current:
                return None if record is None else (record[1], record[0], False)
            self._shared["record"] = ((current or 0) + 1, bytes(state))
            return None


def _two_nodes(make: Callable[[SilentBackend], Any]) -> list[tuple[int, int]]:
    """Run a round of two handlers ``make`` builds over one silent backend; (rank, world size)."""
    shared: dict[str, Any] = {"lock": threading.Lock()}
    handlers = [make(SilentBackend(shared)) for _ in range(2)]
    found: list[tuple[int, int]] = []
    errors: list[BaseException] = []

    def join(handler: Any) -> None:
        try:
            info = handler.next_rendezvous()
            found.append((info.rank, info.world_size))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(h,), daemon=True) for h in handlers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=75)
    for handler in handlers:
        handler.shutdown()
    assert not errors, errors
    return sorted(found)


def test_torch_completes_the_round() -> None:
    store = torch_dist.HashStore()  # type: ignore[attr-defined]
    timeout = torch_dynamic.RendezvousTimeout(
        join=timedelta(seconds=60), last_call=timedelta(seconds=0.1)
    )
    ranks = _two_nodes(
        lambda backend: torch_dynamic.DynamicRendezvousHandler.from_backend(
            "silent-run", store, backend, 2, 2, "127.0.0.1", timeout
        )
    )
    assert ranks == [(0, 2), (1, 2)]


@pytest.mark.parametrize("store_kind", ["torch", "rdzv"])
def test_rdzv_completes_the_round(store_kind: str) -> None:
    store = torch_dist.HashStore() if store_kind == "torch" else HashStore()  # type: ignore[attr-defined]
    timeout = rdzv.RendezvousTimeout(join=60, last_call=0.1)

    def make(backend: SilentBackend) -> rdzv.DynamicRendezvousHandler:
        handler = rdzv.DynamicRendezvousHandler.from_backend(
            "silent-run", store, backend, 2, 2, "127.0.0.1", timeout, keep_alive_interval=0.2
        )
        assert handler.get_backend() == "silent"
        return handler

    assert _two_nodes(make) == [(0, 2), (1, 2)]
