"""etcd over TLS with client certificates made by the test (openssl CLI)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from rdzv.api import RendezvousParameters
from rdzv.backends.etcd import create_backend, parse_endpoints
from rdzv.backends.etcd.client import EtcdClientBase
from rdzv.errors import RendezvousConnectionError
from tests.certs import TLSFiles
from tests.engines.servers import EtcdCluster, etcd_cluster

pytestmark = [
    pytest.mark.etcd,
    pytest.mark.timeout(90),
    pytest.mark.xdist_group("etcd-tls"),  # one worker starts the module's TLS etcd, once
]


@pytest.fixture(scope="module")
def tls_etcd(tls_files: TLSFiles) -> Iterator[EtcdCluster]:
    with etcd_cluster(1, tls=tls_files) as cluster:
        yield cluster


@pytest.mark.parametrize("client", ["gateway", "grpc"])
def test_tls_with_client_certificate_works(
    tls_etcd: EtcdCluster, tls_files: TLSFiles, client: str
) -> None:
    params = RendezvousParameters(
        "etcd",
        tls_etcd.endpoint,
        f"tlsrun-{client}",
        protocol="https",
        ssl_cert=tls_files.client_cert,
        ssl_cert_key=tls_files.client_key,
        cacert=tls_files.ca_cert,  # torch's etcd handler's name for ca_cert
        read_timeout=10,
        client=client,
    )
    backend, store = create_backend(params)
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


def test_wrong_ca_gives_a_clear_error(
    tls_etcd: EtcdCluster, tls_files: TLSFiles, etcd_client_type: type[EtcdClientBase]
) -> None:
    client = etcd_client_type(
        parse_endpoints(tls_etcd.endpoint),
        protocol="https",
        read_timeout=5,
        ssl_cert=tls_files.client_cert,
        ssl_cert_key=tls_files.client_key,
        ca_cert=tls_files.other_ca_cert,
    )
    try:
        with pytest.raises(
            RendezvousConnectionError, match="did not verify against ca_cert"
        ) as info:
            client.get(b"/x")
        assert tls_etcd.endpoint in str(info.value)
    finally:
        client.close()


def test_missing_client_certificate_gives_a_clear_error(
    tls_etcd: EtcdCluster, tls_files: TLSFiles, etcd_client_type: type[EtcdClientBase]
) -> None:
    client = etcd_client_type(
        parse_endpoints(tls_etcd.endpoint),
        protocol="https",
        read_timeout=5,
        ca_cert=tls_files.ca_cert,
    )
    try:
        with pytest.raises(RendezvousConnectionError, match="client certificate") as info:
            client.get(b"/x")
        assert tls_etcd.endpoint in str(info.value)
    finally:
        client.close()


def test_plain_http_to_a_tls_server_fails_with_the_endpoint(
    tls_etcd: EtcdCluster, etcd_client_type: type[EtcdClientBase]
) -> None:
    endpoints = parse_endpoints(tls_etcd.endpoint)
    client = etcd_client_type(endpoints, read_timeout=1, connect_timeout=0.5)
    try:
        with pytest.raises(RendezvousConnectionError, match=tls_etcd.endpoint):
            client.get(b"/x")
    finally:
        client.close()
