"""Item 5: the registry checks what a creator built, as torch's does; an alias and its
canonical name count as the same backend."""

from __future__ import annotations

import pytest
from torch.distributed.elastic.rendezvous import api as torch_api

import rdzv
from rdzv.registry import canonical_backend_name
from tests.torchcompat.helpers import same_error
from tests.unit.test_api import _Handler


class _RdzvNamed(_Handler):
    def __init__(self, name: str) -> None:
        self.name = name
        self.closed = False

    def get_backend(self) -> str:
        return self.name

    def close(self) -> None:
        self.closed = True


def _torch_named(name: str) -> torch_api.RendezvousHandler:
    class Named(torch_api.RendezvousHandler):
        def get_backend(self) -> str:
            return name

        def next_rendezvous(self) -> torch_api.RendezvousInfo:
            raise AssertionError("not called")

        def is_closed(self) -> bool:
            return False

        def set_closed(self) -> None:
            pass

        def num_nodes_waiting(self) -> int:
            return 0

        def get_run_id(self) -> str:
            return "r"

        def shutdown(self) -> bool:
            return True

    return Named()


def test_a_handler_of_another_backend_is_a_runtime_error() -> None:
    built: list[_RdzvNamed] = []

    def torch_call() -> object:
        registry = torch_api.RendezvousHandlerRegistry()
        registry.register("mine", lambda params: _torch_named("theirs"))
        return registry.create_handler(torch_api.RendezvousParameters("mine", "h", "r", 1, 1))

    def rdzv_call() -> object:
        def create(params: rdzv.RendezvousParameters) -> _RdzvNamed:
            built.append(_RdzvNamed("theirs"))
            return built[-1]

        registry = rdzv.RendezvousHandlerRegistry(load_entry_points=False)
        registry.register("mine", create)
        return registry.create_handler(rdzv.RendezvousParameters("mine", "h", "r", 1, 1))

    same_error(torch_call, rdzv_call, RuntimeError)
    assert built[0].closed  # rdzv releases what it will not return


def test_a_handler_of_the_requested_backend_is_returned_by_both() -> None:
    torch_registry = torch_api.RendezvousHandlerRegistry()
    torch_registry.register("mine", lambda params: _torch_named("mine"))
    torch_handler = torch_registry.create_handler(
        torch_api.RendezvousParameters("mine", "h", "r", 1, 1)
    )
    rdzv_registry = rdzv.RendezvousHandlerRegistry(load_entry_points=False)
    rdzv_registry.register("mine", lambda params: _RdzvNamed("mine"))
    rdzv_handler = rdzv_registry.create_handler(rdzv.RendezvousParameters("mine", "h", "r", 1, 1))
    assert torch_handler.get_backend() == rdzv_handler.get_backend() == "mine"


@pytest.mark.parametrize(
    ("requested", "reported"),
    [
        ("p10d", "c10d"),
        ("core", "c10d"),
        ("tcp", "c10d"),
        ("c10d", "c10d"),
        ("etcd", "etcd-v3"),
        ("etcd-v2", "etcd-v3"),
    ],
)
def test_an_alias_and_its_canonical_name_are_the_same_backend(
    requested: str, reported: str
) -> None:
    registry = rdzv.RendezvousHandlerRegistry(load_entry_points=False)
    registry.register(requested, lambda params: _RdzvNamed(reported))
    handler = registry.create_handler(rdzv.RendezvousParameters(requested, "h", "r", 1, 1))
    assert handler.get_backend() == reported
    assert canonical_backend_name(requested) == canonical_backend_name(reported)


@pytest.mark.parametrize(("requested", "reported"), [("etcd", "c10d"), ("p10d", "redis")])
def test_different_canonical_names_are_rejected(requested: str, reported: str) -> None:
    registry = rdzv.RendezvousHandlerRegistry(load_entry_points=False)
    registry.register(requested, lambda params: _RdzvNamed(reported))
    with pytest.raises(RuntimeError, match=f"The rendezvous backend '{reported}' does not match"):
        registry.create_handler(rdzv.RendezvousParameters(requested, "h", "r", 1, 1))
