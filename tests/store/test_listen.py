"""Where a hosted store listens: the address it publishes and loopback, not every address.

Issue 51 part 5: a master store listened on every address while it published
one (``MASTER_ADDR=127.0.0.1``, yet reachable from the network). Here the
published address is 127.0.0.1 and the "other" address of this machine is
127.0.0.2 (loopback range, always this machine's): a connection to it must
be refused, unless the server was asked to listen on all.
"""

from __future__ import annotations

import logging
import socket

import pytest

from rdzv.backends.options import StoreBackendOptions
from rdzv.backends.store import open_store
from rdzv.launch import AgentConfig, ElasticAgent
from rdzv.launch.bootstrap import BootstrapSpec, rdzv_store_server
from rdzv.net import listen_addresses
from rdzv.store.tcp import TCPStore
from tests.launch.fakes import FakeGroup, FakeHandler
from tests.procs import free_port

OTHER = "127.0.0.2"
"""An address of this machine that the stores below do not publish."""


def reachable(address: str, port: int) -> bool:
    """Whether a TCP connection to ``address:port`` is accepted."""
    try:
        with socket.create_connection((address, port), timeout=5):
            return True
    except ConnectionRefusedError:
        return False


def test_a_published_address_listens_there_and_on_loopback() -> None:
    assert listen_addresses("127.0.0.1") == ["127.0.0.1"]  # --standalone: loopback only
    assert set(listen_addresses("localhost") or ["every address"]) <= {"127.0.0.1", "::1"}
    assert listen_addresses(OTHER) == [OTHER, "127.0.0.1"]
    assert listen_addresses("127.0.0.1", listen_all=True) is None
    assert listen_addresses("0.0.0.0") is None


def test_an_address_not_of_this_machine_listens_on_all_and_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # 192.0.2.0/24 is TEST-NET-1: never this machine's (an address behind NAT, say).
    with caplog.at_level(logging.WARNING, logger="rdzv.net"):
        assert listen_addresses("192.0.2.71") is None
        assert listen_addresses("192.0.2.71") is None
        assert listen_addresses("no-such-host.invalid") is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "192.0.2.71 is not one of this machine's own" in lines[0]
    assert "listening on every address" in lines[0]


def test_a_store_hosted_at_a_published_address_refuses_connections_to_another() -> None:
    with TCPStore("127.0.0.1", 0, is_master=True, listen=listen_addresses("127.0.0.1")) as master:
        master.set("k", "v")
        assert reachable("127.0.0.1", master.port)
        assert not reachable(OTHER, master.port)
    with TCPStore("127.0.0.1", 0, is_master=True) as everywhere:  # torch's way, the default
        assert reachable(OTHER, everywhere.port)


@pytest.mark.parametrize(("listen_all", "refused"), [(False, True), (True, False)])
def test_the_c10d_store_listens_where_its_endpoint_is_unless_listen_all(
    listen_all: bool, refused: bool
) -> None:
    port = free_port()
    options = StoreBackendOptions("127.0.0.1", port, "run", is_host=True, listen_all=listen_all)
    backend, store = open_store(options)
    try:
        assert reachable("127.0.0.1", port)
        assert reachable(OTHER, port) is not refused
    finally:
        backend.close()
        store.close()


def test_listen_all_is_an_rdzv_conf_key_of_the_c10d_backend() -> None:
    from rdzv.api import RendezvousParameters

    params = RendezvousParameters("c10d", "127.0.0.1:29400", "run", 1, 1, listen_all="true")
    assert StoreBackendOptions.from_params(params).listen_all is True
    params = RendezvousParameters("c10d", "127.0.0.1:29400", "run", 1, 1)
    assert StoreBackendOptions.from_params(params).listen_all is False


@pytest.mark.parametrize(("listen_all", "refused"), [(False, True), (True, False)])
def test_the_workers_bootstrap_store_listens_where_it_is_published(
    listen_all: bool, refused: bool
) -> None:
    config = AgentConfig(["train.py"], local_addr="127.0.0.1", listen_all=listen_all)
    agent = ElasticAgent(FakeHandler(FakeGroup(1), 0), config)
    server = agent._bootstrap_factory(BootstrapSpec(4, 1, agent._listen))
    try:
        assert reachable("127.0.0.1", server.port)  # where the agent and its workers connect
        assert reachable(OTHER, server.port) is not refused
    finally:
        server.close()
    server = rdzv_store_server(BootstrapSpec(4))  # asked for no address: every one, as before
    try:
        assert reachable(OTHER, server.port)
    finally:
        server.close()


def test_the_torchrun_plugins_server_child_listens_where_it_is_told() -> None:
    from rdzv.torchrun.server_child import _ServerProcess

    server = _ServerProcess.start(0, None, None, listen_addresses("127.0.0.1"))
    try:
        assert reachable("127.0.0.1", server.port)
        assert not reachable(OTHER, server.port)
    finally:
        server.stop()
