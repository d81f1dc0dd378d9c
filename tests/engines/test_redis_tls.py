"""Redis over TLS (rediss) with client certificates made by the test."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from rdzv.api import RendezvousParameters
from rdzv.errors import RendezvousConnectionError
from tests.certs import TLSFiles
from tests.engines.servers import RedisServer, redis_server

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def tls_redis(tls_files: TLSFiles) -> Iterator[RedisServer]:
    with redis_server(tls=tls_files) as server:
        yield server


def _params(server: RedisServer, unique: str, **tls: Any) -> RendezvousParameters:
    return RendezvousParameters(
        "redis", server.endpoint, unique, protocol="rediss", read_timeout=5, **tls
    )


def test_rediss_with_client_certificate_works(
    tls_redis: RedisServer, tls_files: TLSFiles, unique: str
) -> None:
    from rdzv.backends.redis import create_backend

    backend, store = create_backend(
        _params(
            tls_redis,
            unique,
            ssl_cert=tls_files.client_cert,
            ssl_cert_key=tls_files.client_key,
            ca_cert=tls_files.ca_cert,
        )
    )
    try:
        result = backend.set_state(b"secure")
        assert result is not None
        _, token, written = result
        assert written
        assert backend.get_state() == (b"secure", token)
        store.set("k", b"v")
        assert store.get("k") == b"v"
    finally:
        backend.client.close()


def test_rediss_with_a_wrong_ca_names_the_endpoint(
    tls_redis: RedisServer, tls_files: TLSFiles, unique: str
) -> None:
    from rdzv.backends.redis import create_backend

    # create_backend checks the server at once (one PING), so it fails there.
    with pytest.raises(RendezvousConnectionError, match=tls_redis.endpoint) as info:
        create_backend(
            _params(
                tls_redis,
                unique,
                ssl_cert=tls_files.client_cert,
                ssl_cert_key=tls_files.client_key,
                ca_cert=tls_files.other_ca_cert,
            )
        )
    assert "certificate" in str(info.value).lower()


def test_rediss_without_a_client_certificate_fails(
    tls_redis: RedisServer, tls_files: TLSFiles, unique: str
) -> None:
    from rdzv.backends.redis import create_backend

    with pytest.raises(RendezvousConnectionError, match=tls_redis.endpoint):
        create_backend(_params(tls_redis, unique, ca_cert=tls_files.ca_cert))
