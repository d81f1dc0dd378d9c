"""rdzv's torchrun handlers in-process: parameters, errors, stores, close-on-finish."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rdzv import errors
from rdzv.api import given_node_rank
from rdzv.registry import RendezvousHandlerRegistry
from tests.procs import free_port
from tests.torchrun.conftest import torchrun_env

torch_api = pytest.importorskip("torch.distributed.elastic.rendezvous")
from torch.distributed.elastic.utils.store import barrier  # noqa: E402

from rdzv import torchrun  # noqa: E402
from rdzv.torchrun.handler import _Resources, _torch_errors, _wrap  # noqa: E402
from rdzv.torchrun.stores import _RankZeroStores  # noqa: E402

pytestmark = pytest.mark.torch

FAST = {"last_call_timeout": "0.2", "join_timeout": "20", "keep_alive_interval": "1"}


def torch_params(
    backend: str = "rdzv",
    endpoint: str = "127.0.0.1:29400",
    run_id: str = "job",
    min_nodes: int = 1,
    max_nodes: int = 1,
    **config: Any,
) -> Any:
    return torch_api.RendezvousParameters(backend, endpoint, run_id, min_nodes, max_nodes, **config)


def test_parameters_keep_rdzv_conf_strings_and_map_the_node_rank() -> None:
    params = torch_params(
        endpoint="10.0.0.1:1234",
        min_nodes=2,
        max_nodes=4,
        local_addr="10.0.0.2",
        timeout=900,
        rank=3,
        join_timeout="12.5",
        is_host="0",
    )
    converted = torchrun.to_rdzv_parameters(params, "c10d")
    assert (converted.backend, converted.endpoint, converted.run_id) == (
        "c10d",
        "10.0.0.1:1234",
        "job",
    )
    assert (converted.min_nodes, converted.max_nodes) == (2, 4)
    assert converted.local_addr == "10.0.0.2"
    assert converted.node_rank == given_node_rank(converted) == 3
    assert "timeout" not in converted.config
    assert converted.timeout.join.total_seconds() == 12.5
    assert converted.get_as_bool("is_host") is False


def test_no_rank_in_the_conf_is_no_given_node_rank() -> None:
    converted = torchrun.to_rdzv_parameters(torch_params(), "c10d")
    assert (converted.node_rank, given_node_rank(converted)) == (0, None)


def test_a_bad_node_rank_is_named() -> None:
    with pytest.raises(ValueError, match="'x'"):
        torchrun.to_rdzv_parameters(torch_params(rank="x"), "c10d")


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (errors.RendezvousGracefulExitError("spare"), "RendezvousGracefulExitError"),
        (errors.RendezvousClosedError("closed"), "RendezvousClosedError"),
        (errors.RendezvousExhaustedError("run_id=job", 5), "RendezvousTimeoutError"),
        (errors.StoreTimeoutError("slow"), "RendezvousTimeoutError"),
        (errors.RendezvousConnectionError("down"), "RendezvousConnectionError"),
        (errors.RendezvousStateError("corrupt"), "RendezvousStateError"),
        (errors.StoreAuthenticationError("secret"), "RendezvousError"),
    ],
)
def test_rdzv_errors_become_torch_errors(raised: Exception, expected: str) -> None:
    with pytest.raises(getattr(torch_api, expected)) as caught, _torch_errors():
        raise raised
    assert type(caught.value) is getattr(torch_api, expected)
    assert caught.value.__cause__ is raised
    assert str(raised) in str(caught.value)


@pytest.mark.parametrize(("name", "engine"), [("rdzv-etcd", "etcd"), ("rdzv-redis", "redis")])
def test_a_missing_engine_backend_is_named(
    name: str, engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    bare = RendezvousHandlerRegistry(load_entry_points=False)
    monkeypatch.setattr(torchrun, "rendezvous_handler_registry", bare)
    creator = torchrun.etcd_creator() if engine == "etcd" else torchrun.redis_creator()
    with pytest.raises(ValueError, match=rf"{name}.*'{engine}'"):
        creator(torch_params(backend=name))


def _python(code: str, entry_points_path: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter that sees the torchrun entry points."""
    return subprocess.run(
        [sys.executable, "-c", code],
        env=torchrun_env(entry_points_path),
        capture_output=True,
        text=True,
        timeout=50,
        check=True,
    )


@pytest.mark.timeout(60)
def test_torch_registers_the_three_entry_points(entry_points_path: str) -> None:
    code = (
        "from torch.distributed.elastic.rendezvous.registry import handler_registry as r\n"
        "from torch.distributed.elastic.rendezvous import registry\n"
        "registry._register_out_of_tree_handlers()\n"
        "print(sorted(n for n in r._registry if n.startswith('rdzv')))\n"
    )
    out = _python(code, entry_points_path)
    assert out.stdout.strip() == "['rdzv', 'rdzv-etcd', 'rdzv-redis']", out.stderr


@pytest.fixture
def make_handler() -> Iterator[Callable[..., Any]]:
    """Build ``rdzv`` torchrun handlers; every one is shut down at the end."""
    made: list[Any] = []

    def make(endpoint: str, run_id: str, nodes: int = 1) -> Any:
        handler = torchrun.create_rdzv_handler(
            torch_params("rdzv", endpoint, run_id, nodes, nodes, **FAST)
        )
        made.append(handler)
        return handler

    try:
        yield make
    finally:
        for handler in reversed(made):  # clients first, the server host last
            handler.shutdown()


def rendezvous_all(handlers: list[Any]) -> list[Any]:
    infos: list[Any] = [None] * len(handlers)
    failures: list[BaseException] = []

    def run(i: int) -> None:
        try:
            infos[i] = handlers[i].next_rendezvous()
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(handlers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not failures, failures
    assert all(info is not None for info in infos)
    return infos


@pytest.mark.timeout(60)
def test_a_round_gives_torch_a_real_store_of_a_server_in_a_child_process(
    make_handler: Callable[..., Any],
) -> None:
    import torch.distributed as dist

    endpoint, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex
    host, client = make_handler(endpoint, run_id, 2), make_handler(endpoint, run_id, 2)
    assert isinstance(host, torch_api.RendezvousHandler)
    assert host._resources.server is not None
    assert client._resources.server is None
    assert host.get_backend() == "rdzv"
    assert host.get_run_id() == run_id
    assert host.use_agent_store is False
    first = rendezvous_all([host, client])
    assert sorted(info.rank for info in first) == [0, 1]
    assert {info.world_size for info in first} == {2}
    assert (
        len(
            {
                (i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port)
                for i in first
            }
        )
        == 1
    )
    store0, store1 = first[0].store, first[1].store
    assert isinstance(store0, dist.Store)  # type: ignore[attr-defined]
    # What torch's agent does with it: multi_set/multi_get, add, wait/check, list_keys.
    store0.multi_set(["a", "b"], ["1", "2"])  # type: ignore[attr-defined]
    assert store1.multi_get(["a", "b"]) == [b"1", b"2"]
    assert store1.add("n", 2) == 2
    store1.wait(["a"])
    assert store0.check(["a"])
    assert not store0.check(["missing"])
    assert host.num_nodes_waiting() == 0
    assert not host.is_closed()
    second = rendezvous_all([host, client])
    assert not second[0].store.check(["a"]), "a new round must not see the last round's keys"


@pytest.mark.timeout(60)
def test_shutdown_after_the_exit_barrier_closes_the_run(make_handler: Callable[..., Any]) -> None:
    endpoint, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex
    host, client = make_handler(endpoint, run_id, 2), make_handler(endpoint, run_id, 2)
    infos = rendezvous_all([host, client])
    done = [
        threading.Thread(target=barrier, args=(i.store, 2, "torchelastic/agent/terminal_state", 20))
        for i in infos
    ]
    for thread in done:
        thread.start()
    for thread in done:
        thread.join(30)
    assert client.shutdown() is True
    assert host.is_closed()


@pytest.mark.timeout(60)
def test_shutdown_after_a_failure_leaves_without_closing(make_handler: Callable[..., Any]) -> None:
    endpoint, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex
    host, client = make_handler(endpoint, run_id, 2), make_handler(endpoint, run_id, 2)
    rendezvous_all([host, client])
    assert client.shutdown() is True
    assert not host.is_closed()
    assert host.num_nodes_waiting() > 0, "the others must see that a member left"


def test_is_host_with_a_taken_port_is_a_connection_error() -> None:
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        params = torch_params("rdzv", f"127.0.0.1:{port}", "job", is_host="1")
        with pytest.raises(
            torch_api.RendezvousConnectionError, match=rf"port {port} .*already in use"
        ):
            torchrun.create_rdzv_handler(params)


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        ({"ca_cert": "ca.pem", "is_host": "1"}, "no ssl_cert/ssl_cert_key"),
        ({"ssl_cert": "c.pem"}, "ssl_cert is set without ssl_cert_key"),
        (
            {"ca_cert": "ca.pem", "ssl_cert": "c.pem", "ssl_cert_key": "k.pem"},
            r"ssl_cert '.*c.pem' / ssl_cert_key '.*k.pem' cannot be loaded",
        ),
        ({"ca_cert": "missing.pem"}, r"ca_cert '.*missing.pem' cannot be loaded: no such file"),
    ],
    ids=["host-without-cert", "cert-without-key", "unreadable-cert", "missing-file"],
)
def test_tls_settings_errors_are_named_before_anything_starts(
    conf: dict[str, str], message: str, tmp_path: Path
) -> None:
    for name in ("ca.pem", "c.pem", "k.pem"):
        (tmp_path / name).write_text("not a certificate\n")
    conf = {k: v if k == "is_host" else str(tmp_path / v) for k, v in conf.items()}
    params = torch_params("rdzv", f"127.0.0.1:{free_port()}", "job", 1, 1, **conf)
    with pytest.raises(ValueError, match=message):
        torchrun.create_rdzv_handler(params)


def test_a_bad_spare_exit_is_named() -> None:
    with pytest.raises(ValueError, match="'bogus'"):
        torchrun.create_rdzv_handler(torch_params(spare_exit="bogus"))


@pytest.mark.timeout(60)
def test_engine_backends_get_a_store_hosted_by_group_rank_zero() -> None:
    # The stores rdzv-etcd/rdzv-redis hand out, over the backend every install has.
    from rdzv.backends.store import create_backend
    from rdzv.dynamic.handler import create_handler

    endpoint, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex
    handlers = []
    for _ in range(2):
        params = torchrun.to_rdzv_parameters(
            torch_params("rdzv-etcd", endpoint, run_id, 2, 2, **FAST), "c10d"
        )
        backend, store = create_backend(params)
        resources = _Resources(_RankZeroStores(20), (backend.close, store.close))
        inner = create_handler(store, backend, params)
        handlers.append(_wrap("rdzv-etcd", inner, resources, "raise"))
    try:
        first = sorted(rendezvous_all(handlers), key=lambda info: info.rank)
        first[0].store.set("k", "v")
        assert first[1].store.get("k") == b"v"
        second = sorted(rendezvous_all(handlers), key=lambda info: info.rank)
        assert not second[1].store.check(["k"]), "each round gets a fresh store"
        second[1].store.set("k2", "v2")
        assert second[0].store.get("k2") == b"v2"
    finally:
        for handler in reversed(handlers):  # the in-process server's host last
            handler.shutdown()


@pytest.mark.timeout(60)
def test_a_bad_rendezvous_option_stops_the_server_child() -> None:
    port = free_port()
    with pytest.raises(ValueError, match="keep_alive_max_attempt"):
        torchrun.create_rdzv_handler(
            torch_params("rdzv", f"127.0.0.1:{port}", "job", keep_alive_max_attempt="many")
        )
    # The child that served the port is gone: the port can be bound again.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


@pytest.mark.timeout(60)
def test_importing_the_plugin_does_not_import_torch(entry_points_path: str) -> None:
    code = (
        "import sys, rdzv, rdzv.torchrun\n"
        "rdzv.torchrun.tcp_creator(); rdzv.torchrun.etcd_creator()\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = _python(code, entry_points_path)
    assert out.stdout.strip() == "[]", out.stderr
