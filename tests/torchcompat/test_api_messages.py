"""Item 1: parameters, timeouts, the registry and ``from_backend`` fail as torch's do,
the message starting with torch 2.13's text."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as torch_dist
from torch.distributed.elastic.rendezvous import api as torch_api
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as torch_dynamic

import rdzv
from rdzv.store.memory import HashStore
from rdzv.testing.memory import InMemoryBackend
from tests.torchcompat.helpers import same_error


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        (("", "h:1", "r", 1, 1), {}),
        (("c10d", "h:1", "r", 0, 1), {}),
        (("c10d", "h:1", "r", -3, 1), {}),
        (("c10d", "h:1", "r", 4, 2), {}),
    ],
)
def test_parameters_validation(args: tuple[object, ...], kwargs: dict[str, object]) -> None:
    same_error(
        lambda: torch_api.RendezvousParameters(*args, **kwargs),  # type: ignore[arg-type]
        lambda: rdzv.RendezvousParameters(*args, **kwargs),  # type: ignore[arg-type]
        ValueError,
    )


@pytest.mark.parametrize("value", ["maybe", "2", "", "yes please", 7])
def test_get_as_bool_on_an_invalid_value(value: object) -> None:
    same_error(
        lambda: torch_api.RendezvousParameters("c10d", "h", "r", 1, 1, flag=value).get_as_bool(
            "flag"
        ),
        lambda: rdzv.RendezvousParameters("c10d", "h", "r", 1, 1, flag=value).get_as_bool("flag"),
        ValueError,
    )


@pytest.mark.parametrize("value", ["ten", "1.5", "", "0x10"])
def test_get_as_int_on_an_invalid_value(value: object) -> None:
    same_error(
        lambda: torch_api.RendezvousParameters("c10d", "h", "r", 1, 1, n=value).get_as_int("n"),
        lambda: rdzv.RendezvousParameters("c10d", "h", "r", 1, 1, n=value).get_as_int("n"),
        ValueError,
    )


@pytest.mark.parametrize("field", ["join", "last_call", "close", "heartbeat"])
@pytest.mark.parametrize("value", [timedelta(0), timedelta(seconds=-3), timedelta(days=-2)])
def test_timeout_non_positive(field: str, value: timedelta) -> None:
    torch_error, rdzv_error = same_error(
        lambda: torch_dynamic.RendezvousTimeout(**{field: value}),
        lambda: rdzv.RendezvousTimeout(**{field: value}),
        ValueError,
    )
    assert str(rdzv_error) == str(torch_error)


def test_timeout_in_seconds_reads_as_torchs_timedelta() -> None:
    # rdzv also takes seconds; the message shows them as torch shows the timedelta.
    same_error(
        lambda: torch_dynamic.RendezvousTimeout(join=timedelta(seconds=-5)),
        lambda: rdzv.RendezvousTimeout(join=-5),
        ValueError,
    )


@pytest.mark.parametrize("key", ["join_timeout", "last_call_timeout", "close_timeout"])
@pytest.mark.parametrize("value", ["0", "-7", "soon"])
def test_timeouts_from_parameters(key: str, value: str) -> None:
    config: dict[str, Any] = {key: value}

    def torch_call() -> object:
        params = torch_api.RendezvousParameters("c10d", "h", "r", 1, 1, **config)
        return torch_dynamic.create_handler(torch_dist.HashStore(), _TorchBackend(), params)  # type: ignore[attr-defined]

    def rdzv_call() -> object:
        params = rdzv.RendezvousParameters("c10d", "h", "r", 1, 1, **config)
        return rdzv.RendezvousSettings.from_params(params)

    same_error(torch_call, rdzv_call, ValueError)


class _TorchBackend(torch_dynamic.RendezvousBackend):
    """A torch backend that is never called: the checks come first."""

    @property
    def name(self) -> str:
        return "fake"

    def get_state(self) -> None:
        raise AssertionError("not called")

    def set_state(self, state: bytes, token: object = None) -> None:
        raise AssertionError("not called")


@pytest.mark.parametrize(
    ("run_id", "min_nodes", "max_nodes"), [("", 1, 1), ("r", 0, 1), ("r", 3, 2)]
)
def test_from_backend(run_id: str, min_nodes: int, max_nodes: int) -> None:
    same_error(
        lambda: torch_dynamic.DynamicRendezvousHandler.from_backend(
            run_id,
            torch_dist.HashStore(),  # type: ignore[attr-defined]
            _TorchBackend(),
            min_nodes,
            max_nodes,
        ),
        lambda: rdzv.DynamicRendezvousHandler.from_backend(
            run_id, HashStore(), InMemoryBackend(), min_nodes, max_nodes
        ),
        ValueError,
    )


def _creator(params: object) -> object:
    raise AssertionError("not called")


def _other_creator(params: object) -> object:
    raise AssertionError("not called")


def test_registry_register_twice_with_different_creators() -> None:
    def torch_call() -> None:
        registry = torch_api.RendezvousHandlerRegistry()
        registry.register("mine", _creator)  # type: ignore[arg-type]
        registry.register("mine", _other_creator)  # type: ignore[arg-type]

    def rdzv_call() -> None:
        registry = rdzv.RendezvousHandlerRegistry(load_entry_points=False)
        registry.register("mine", _creator)  # type: ignore[arg-type]
        registry.register("mine", _other_creator)  # type: ignore[arg-type]

    same_error(torch_call, rdzv_call, ValueError)


def test_registry_register_an_empty_name() -> None:
    same_error(
        lambda: torch_api.RendezvousHandlerRegistry().register("", _creator),  # type: ignore[arg-type]
        lambda: rdzv.RendezvousHandlerRegistry(load_entry_points=False).register("", _creator),  # type: ignore[arg-type]
        ValueError,
    )


def test_registry_unknown_backend() -> None:
    same_error(
        lambda: torch_api.RendezvousHandlerRegistry().create_handler(
            torch_api.RendezvousParameters("nosuch", "h", "r", 1, 1)
        ),
        lambda: rdzv.RendezvousHandlerRegistry(load_entry_points=False).create_handler(
            rdzv.RendezvousParameters("nosuch", "h", "r", 1, 1)
        ),
        ValueError,
    )
