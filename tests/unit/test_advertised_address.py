"""advertised_address: the address facing the endpoint, never the host name's loopback."""

from __future__ import annotations

import pytest

from rdzv.net import advertised_address, primary_address


@pytest.mark.parametrize(
    "endpoint",
    ["127.0.0.1:29400", "127.0.0.1", "http://127.0.0.1:2379,10.255.255.1:2379", " 127.0.0.1:1/ "],
)
def test_an_endpoint_on_loopback_gives_loopback(endpoint: str) -> None:
    assert advertised_address(endpoint) == "127.0.0.1"


def test_an_ipv6_loopback_endpoint_gives_ipv6_loopback() -> None:
    assert advertised_address("[::1]:29400") == "::1"


@pytest.mark.parametrize("endpoint", ["", "host:port:extra:", "no-such-host.invalid:29400"])
def test_an_endpoint_without_a_route_falls_back_to_the_primary_address(endpoint: str) -> None:
    assert advertised_address(endpoint) == primary_address()


def test_the_handler_built_from_parameters_publishes_the_address_facing_the_endpoint() -> None:
    from rdzv.api import RendezvousParameters
    from rdzv.dynamic.handler import create_handler
    from rdzv.store.memory import HashStore
    from rdzv.testing.memory import InMemoryBackend

    params = RendezvousParameters("c10d", "127.0.0.1:29400", "run", 1, 1)
    handler = create_handler(HashStore(), InMemoryBackend(), params)
    try:
        assert handler.node.startswith("127.0.0.1#"), handler.node
    finally:
        handler.close()
