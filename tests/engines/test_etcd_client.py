"""Both etcd v3 clients (gateway and gRPC) against a real etcd: KV, txn, watch, compaction, leases, failover."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from rdzv.backends.etcd import EtcdRendezvousBackend, parse_endpoints
from rdzv.backends.etcd.client import EtcdClientBase
from rdzv.backends.etcd.gateway import EtcdClient
from rdzv.backends.etcd.gateway_codec import EtcdCompactedError, WatchEvent, prefix_range_end
from rdzv.backends.etcd.store import EtcdStore
from rdzv.errors import RendezvousConnectionError
from tests.engines.servers import EtcdCluster, etcd_cluster, kill_process
from tests.procs import free_port

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(60)]


def test_prefix_range_end() -> None:
    assert prefix_range_end(b"/a/") == b"/a0"
    assert prefix_range_end(b"a\xff") == b"b"
    assert prefix_range_end(b"\xff\xff") == b"\0"


def test_parse_endpoints() -> None:
    assert parse_endpoints("h1:1,h2, [::1]:3") == [("h1", 1), ("h2", 2379), ("::1", 3)]
    assert parse_endpoints("http://h1:5/") == [("h1", 5)]
    with pytest.raises(ValueError, match="names no member"):
        parse_endpoints(" , ")
    with pytest.raises(ValueError, match="port"):
        parse_endpoints("h1:notaport")


def test_client_option_errors_name_the_value(etcd_client_type: type[EtcdClientBase]) -> None:
    with pytest.raises(ValueError, match="'ftp'"):
        etcd_client_type([("127.0.0.1", 1)], protocol="ftp")
    with pytest.raises(ValueError, match="need protocol=https"):
        etcd_client_type([("127.0.0.1", 1)], ca_cert="/x.pem")
    with pytest.raises(ValueError, match="together"):
        etcd_client_type([("127.0.0.1", 1)], protocol="https", ssl_cert="/x.pem")
    with pytest.raises(ValueError, match="at least one"):
        etcd_client_type([])


def test_put_get_delete_and_prefix(etcd_client: EtcdClientBase, unique: str) -> None:
    base = f"/c/{unique}/".encode()
    rev1 = etcd_client.put(base + b"a", b"1")
    rev2 = etcd_client.put(base + b"b", b"2")
    assert rev2 > rev1
    kv, _ = etcd_client.get(base + b"a")
    assert kv is not None
    assert kv.value == b"1"
    assert kv.mod_revision == rev1
    kvs, _ = etcd_client.range(base, prefix=True)
    assert [k.value for k in kvs] == [b"1", b"2"]
    assert etcd_client.count(base) == 2
    assert etcd_client.delete(base, prefix=True) == 2
    assert etcd_client.get(base + b"a")[0] is None


def test_cas_returns_current_value_on_failure(etcd_client: EtcdClientBase, unique: str) -> None:
    key = f"/c/{unique}".encode()
    written, rev, current, attempts = etcd_client.compare_and_put(key, b"v1", 0)
    assert (written, current, attempts) == (True, None, 1)
    written, _, current, _ = etcd_client.compare_and_put(key, b"v2", 0)
    assert not written
    assert current is not None
    assert current.value == b"v1"
    assert current.mod_revision == rev


def test_watch_returns_events_and_times_out(etcd_client: EtcdClientBase, unique: str) -> None:
    key = f"/c/{unique}".encode()
    _, revision = etcd_client.get(key)
    start = time.monotonic()
    assert etcd_client.watch(key, revision + 1, 0.3) == ([], revision + 1)
    assert time.monotonic() - start < 5
    writer = threading.Timer(0.1, lambda: etcd_client.put(key, b"x"))
    writer.start()
    try:
        events, next_revision = etcd_client.watch(key, revision + 1, 10)
    finally:
        writer.join()
    assert [(e.kind, e.kv.value) for e in events] == [("PUT", b"x")]
    assert next_revision == events[0].kv.mod_revision + 1


def test_watch_latency_is_far_below_polling(etcd_client: EtcdClientBase, unique: str) -> None:
    """A generous bound that catches a fallback to polling, not a benchmark."""
    key = f"/c/{unique}".encode()
    delays = []
    for i in range(5):
        _, revision = etcd_client.get(key)
        stamp: list[float] = []

        def write(value: bytes = str(i).encode(), stamp: list[float] = stamp) -> None:
            time.sleep(0.05)
            stamp.append(time.monotonic())
            etcd_client.put(key, value)

        thread = threading.Thread(target=write)
        thread.start()
        events, _ = etcd_client.watch(key, revision + 1, 10)
        seen = time.monotonic()
        thread.join()
        assert events
        delays.append(seen - stamp[0])
    assert sorted(delays)[2] < 0.5


def _compact(client: EtcdClientBase) -> int:
    """Compact the history up to the current revision (through the gateway, whichever client)."""
    _, revision = client.get(b"/")
    with EtcdClient(parse_endpoints(",".join(client.endpoints))) as gateway:
        gateway.call("/v3/kv/compaction", {"revision": str(revision), "physical": True})
    return revision


def test_watch_from_compacted_revision_raises(etcd_client: EtcdClientBase, unique: str) -> None:
    key = f"/c/{unique}".encode()
    first = etcd_client.put(key, b"1")
    etcd_client.put(key, b"2")
    compacted = _compact(etcd_client)
    with pytest.raises(EtcdCompactedError) as info:
        etcd_client.watch(key, first, 2)
    assert info.value.compact_revision == compacted


def test_backend_and_store_recover_from_compaction(
    etcd_client: EtcdClientBase, unique: str
) -> None:
    backend = EtcdRendezvousBackend(etcd_client, unique, key_prefix="/test/")
    one = backend.set_state(b"one")
    assert one is not None
    _, token, _ = one
    two = backend.set_state(b"two", token)
    assert two is not None
    _, token2, _ = two
    _compact(etcd_client)
    # The token is older than the compaction: the wait re-reads and returns the news.
    assert backend.wait_for_state(token, 5) == (b"two", token2)
    store = EtcdStore(etcd_client, f"/test/{unique}/s/", timeout=5)
    store.set("k", b"a")
    _compact(etcd_client)
    writer = threading.Timer(0.2, lambda: store.set("k", b"b"))
    writer.start()
    try:
        assert store.watch("k", b"a", 10) == b"b"
    finally:
        writer.join()


def test_lease_expiry_deletes_key_and_is_seen_by_watch(
    etcd_client: EtcdClientBase, unique: str
) -> None:
    key = f"/c/{unique}".encode()
    lease, ttl = etcd_client.lease_grant(1)
    assert ttl >= 1
    revision = etcd_client.put(key, b"alive", lease=lease)
    assert etcd_client.lease_keepalive(lease) >= 1
    deadline = time.monotonic() + 10
    events: list[WatchEvent] = []
    while not events and time.monotonic() < deadline:
        events, revision = etcd_client.watch(key, revision + 1, deadline - time.monotonic())
    assert [e.kind for e in events] == ["DELETE"]
    assert etcd_client.get(key)[0] is None
    assert etcd_client.lease_keepalive(lease) <= 0
    etcd_client.lease_revoke(lease)  # revoking an expired lease is not an error


def test_revoke_deletes_attached_keys(etcd_client: EtcdClientBase, unique: str) -> None:
    key = f"/c/{unique}".encode()
    lease, _ = etcd_client.lease_grant(60)
    etcd_client.put(key, b"x", lease=lease)
    etcd_client.lease_revoke(lease)
    assert etcd_client.get(key)[0] is None


def test_unreachable_endpoint_error_names_it(etcd_client_type: type[EtcdClientBase]) -> None:
    port = free_port()
    client = etcd_client_type([("127.0.0.1", port)], read_timeout=0.5, connect_timeout=0.2)
    try:
        with pytest.raises(RendezvousConnectionError, match=f"127.0.0.1:{port}"):
            client.get(b"/x")
        with pytest.raises(RendezvousConnectionError, match=f"127.0.0.1:{port}"):
            client.watch(b"/x", 1, 0.5)
    finally:
        client.close()


def test_a_watch_on_a_member_that_never_answers_is_a_connection_error(
    etcd_client_type: type[EtcdClientBase],
) -> None:
    # A listener that never accepts: the kernel completes TCP's handshake, no byte comes back.
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        client = etcd_client_type([("127.0.0.1", port)], connect_timeout=0.2)
        try:
            with pytest.raises(RendezvousConnectionError, match=f"127.0.0.1:{port}"):
                client.watch(b"/x", 1, 0.5)
        finally:
            client.close()


def test_failover_skips_a_dead_first_member(
    etcd: EtcdCluster, unique: str, etcd_client_type: type[EtcdClientBase]
) -> None:
    dead = free_port()
    endpoints = [("127.0.0.1", dead), *parse_endpoints(etcd.endpoints)]
    client = etcd_client_type(endpoints, read_timeout=5)
    try:
        key = f"/c/{unique}".encode()
        revision = client.put(key, b"v")
        assert client.get(key)[0] is not None
        assert client.watch(key, revision, 2)[0]
    finally:
        client.close()


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_failover_when_the_member_in_use_dies(
    unique: str, etcd_client_type: type[EtcdClientBase]
) -> None:
    with etcd_cluster(3) as cluster:
        client = etcd_client_type(parse_endpoints(cluster.endpoints), read_timeout=10)
        try:
            key = f"/c/{unique}".encode()
            revision = client.put(key, b"1")
            seen: list[list[WatchEvent]] = []
            # The watch runs on member 0 (the client's current member) when it dies.
            watcher = threading.Thread(
                target=lambda: seen.append(client.watch(key, revision + 1, 20)[0])
            )
            watcher.start()
            time.sleep(0.2)
            first = cluster.members[0]
            assert first.proc is not None
            kill_process(first.proc)
            client.put(key, b"2")
            watcher.join(timeout=30)
            assert not watcher.is_alive()
            assert [e.kv.value for e in seen[0]] == [b"2"]
            kv, _ = client.get(key)
            assert kv is not None
            assert kv.value == b"2"
        finally:
            client.close()


@pytest.mark.slow
def test_failover_skips_a_member_that_hangs(
    etcd: EtcdCluster, unique: str, etcd_client_type: type[EtcdClientBase]
) -> None:
    """A member that accepts connections but never answers gets only its share of the budget."""
    import socket

    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(8)
        port = hung.getsockname()[1]
        endpoints = [("127.0.0.1", port), *parse_endpoints(etcd.endpoints)]
        client = etcd_client_type(endpoints, read_timeout=6)
        try:
            start = time.monotonic()
            client.put(f"/c/{unique}".encode(), b"v")
            assert time.monotonic() - start < 6  # the hung member got its share (3 s), not all
            assert client.get(f"/c/{unique}".encode())[0] is not None
        finally:
            client.close()


def test_clients_spread_their_first_member_over_the_cluster() -> None:
    # At the first member, every client of a run loaded one member (about
    # 80% of a formation's requests at 2,048 nodes).
    members = [("127.0.0.1", 1), ("127.0.0.1", 2), ("127.0.0.1", 3)]
    firsts = [EtcdClient(members)._current for _ in range(600)]
    assert all(firsts.count(index) >= 120 for index in range(3)), firsts
