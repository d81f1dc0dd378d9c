"""Building engine backends from RendezvousParameters; TTLs, liveness expiry, unreachable servers."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

import rdzv
from rdzv.api import RendezvousParameters
from rdzv.backends.etcd import EtcdRendezvousBackend, create_backend, parse_endpoints
from rdzv.backends.etcd.client import EtcdClientBase
from rdzv.backends.etcd.gateway import EtcdClient
from rdzv.backends.etcd.grpc import EtcdGrpcClient
from rdzv.backends.etcd.store import EtcdStore
from rdzv.backends.options import EtcdOptions
from rdzv.errors import RendezvousConnectionError
from tests.engines.servers import EtcdCluster, RedisServer
from tests.procs import free_port, wait_until

pytestmark = pytest.mark.timeout(60)


def test_etcd_backend_is_exported() -> None:
    assert rdzv.EtcdRendezvousBackend is EtcdRendezvousBackend


@pytest.mark.etcd
@pytest.mark.parametrize("client", ["gateway", "grpc"])
def test_etcd_create_backend_with_several_members(
    etcd: EtcdCluster, unique: str, client: str
) -> None:
    dead = free_port()
    params = RendezvousParameters(
        "etcd",
        f"127.0.0.1:{dead}, {etcd.endpoint}",
        unique,
        read_timeout="5",
        key_prefix="/params/",
        ttl=30,
        client=client,
    )
    backend, store = create_backend(params)
    try:
        assert isinstance(backend.client, EtcdClient if client == "gateway" else EtcdGrpcClient)
        assert isinstance(store, EtcdStore)
        assert backend.client.endpoints == [
            f"http://127.0.0.1:{dead}",
            f"http://{etcd.endpoint}",
        ]
        assert backend.client.read_timeout == 5.0
        assert backend.key == f"/params/{unique}".encode()
        result = backend.set_state(b"s")
        assert result is not None
        _, token, _ = result
        kv, _ = backend.client.get(backend.key)
        assert kv is not None
        assert kv.mod_revision == token
        assert kv.lease != 0  # the state expires on the server after ttl
        with EtcdClient(parse_endpoints(etcd.endpoint)) as gateway:
            response, _, _ = gateway.call("/v3/lease/timetolive", {"ID": str(kv.lease)})
        assert 0 < int(response["TTL"]) <= 30
        store.set("k", b"v")
        assert store.get("k") == b"v"
    finally:
        backend.client.close()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"protocol": "ftp"}, "'ftp'"),
        ({"read_timeout": "soon"}, "read_timeout"),
        ({"ca_cert": "/ca.pem"}, "protocol=https"),
        ({"ttl": "0"}, "ttl"),
        ({"client": "http2"}, "client='http2'"),
    ],
)
def test_etcd_create_backend_rejects_bad_options(config: dict[str, Any], message: str) -> None:
    params = RendezvousParameters("etcd", "127.0.0.1:1", "run", **config)
    with pytest.raises(ValueError, match=message):
        create_backend(params)


def test_etcd_client_is_grpc_where_grpcio_is_installed_else_the_gateway(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def options(**config: Any) -> EtcdOptions:
        return EtcdOptions.from_params(RendezvousParameters("etcd", "h:1", "run", **config))

    # The dev extra installs grpcio, as the etcd extra does.
    assert options().client == "grpc"
    assert options(client="auto").client == "grpc"
    assert options(client="gateway").client == "gateway"
    assert options(client="grpc").client == "grpc"
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "grpc" else real_find_spec(name, *a),
    )
    assert options().client == "gateway"
    assert options(client="AUTO").client == "gateway"
    with pytest.raises(ValueError, match=r"client=grpc needs grpcio.*rdzv\[etcd\]"):
        options(client="grpc")


def test_etcd_backend_rejects_bad_arguments() -> None:
    client = EtcdClient([("127.0.0.1", 1)])
    try:
        with pytest.raises(ValueError, match="The run id must be a non-empty string"):
            EtcdRendezvousBackend(client, "")
        with pytest.raises(ValueError, match="ttl"):
            EtcdRendezvousBackend(client, "r", ttl=0)
        assert EtcdRendezvousBackend(client, "r").key == b"/rdzv/r"
    finally:
        client.close()


@pytest.mark.etcd
@pytest.mark.timeout(30)
def test_etcd_heartbeat_expires_on_the_server(etcd_client: EtcdClientBase, unique: str) -> None:
    backend = EtcdRendezvousBackend(etcd_client, unique, key_prefix="/live/", liveness_ttl=1)
    backend.beat("node-a")
    assert backend.heartbeat_mark("node-a") is not None
    assert backend.live_nodes() == ["node-a"]
    wait_until(lambda: backend.heartbeat_mark("node-a") is None, "the mark to expire", 15)
    # The node comes back: a new lease is granted and the mark reappears.
    backend.beat("node-a")
    assert backend.heartbeat_mark("node-a") is not None
    backend.forget("node-a")


@pytest.mark.redis
@pytest.mark.timeout(30)
def test_redis_heartbeat_expires_on_the_server(redis_client: Any, unique: str) -> None:
    from rdzv.backends.redis import RedisRendezvousBackend

    backend = RedisRendezvousBackend(redis_client, unique, key_prefix="live:", liveness_ttl=1)
    backend.beat("node-a")
    assert backend.heartbeat_mark("node-a") is not None
    wait_until(lambda: backend.heartbeat_mark("node-a") is None, "the mark to expire", 15)


@pytest.mark.redis
def test_redis_create_backend_and_state_ttl(redis_srv: RedisServer, unique: str) -> None:
    from rdzv.backends.redis import RedisRendezvousBackend, create_backend
    from rdzv.backends.redis.store import RedisStore

    params = RendezvousParameters("redis", redis_srv.endpoint, unique, ttl=30, read_timeout=5)
    backend, store = create_backend(params)
    try:
        assert isinstance(backend, RedisRendezvousBackend)
        assert isinstance(store, RedisStore)
        backend.set_state(b"s")
        assert 0 < backend.client.pttl(backend.key) <= 30_000
        store.set("k", b"v")
        assert store.get("k") == b"v"
    finally:
        backend.client.close()


@pytest.mark.redis
def test_redis_rejects_bad_options() -> None:
    from rdzv.backends.redis import create_backend

    with pytest.raises(ValueError, match="'ftp'"):
        create_backend(RendezvousParameters("redis", "127.0.0.1:1", "r", protocol="ftp"))
    with pytest.raises(ValueError, match="port"):
        create_backend(RendezvousParameters("redis", "127.0.0.1:x", "r"))


@pytest.mark.redis
def test_redis_unreachable_error_names_the_endpoint() -> None:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from rdzv.backends.redis import RedisRendezvousBackend
    from rdzv.backends.redis.store import RedisStore

    port = free_port()
    client = redis.Redis(
        host="127.0.0.1", port=port, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0)
    )
    try:
        backend = RedisRendezvousBackend(client, "r")
        with pytest.raises(RendezvousConnectionError, match=f"127.0.0.1:{port}"):
            backend.get_state()
        with pytest.raises(RendezvousConnectionError, match=f"127.0.0.1:{port}"):
            RedisStore(client, "s:").set("k", b"v")
    finally:
        client.close()


@pytest.mark.redis
def test_redis_client_must_not_decode(redis_srv: RedisServer) -> None:
    import redis

    from rdzv.backends.redis import RedisRendezvousBackend

    client = redis.Redis(host="127.0.0.1", port=redis_srv.port, decode_responses=True)
    try:
        with pytest.raises(ValueError, match="decode_responses"):
            RedisRendezvousBackend(client, "r")
    finally:
        client.close()


@pytest.mark.etcd
def test_etcd_backend_survives_losing_its_state_lease(
    etcd_client: EtcdClientBase, unique: str
) -> None:
    backend = EtcdRendezvousBackend(etcd_client, unique, key_prefix="/lease/")
    backend.set_state(b"one")
    kv, _ = etcd_client.get(backend.key)
    assert kv is not None
    etcd_client.lease_revoke(kv.lease)  # deletes the state and invalidates the cached lease
    assert backend.get_state() is None
    result = backend.set_state(b"two")
    assert result is not None
    assert result[0] == b"two"
    assert result[2] is True
    assert backend.enqueue(0, b"rec") == 1


def test_engine_backends_are_registered() -> None:
    backends = rdzv.rendezvous_handler_registry.backends()
    for name in ("etcd", "etcd-v2", "redis"):
        assert name in backends


def test_redis_backend_without_redis_py_says_what_to_install() -> None:
    import subprocess
    import sys

    from tests.procs import subprocess_env

    code = (
        "import sys; sys.modules['redis'] = None\n"
        "import rdzv\n"
        "try:\n"
        "    rdzv.create_handler(rdzv.RendezvousParameters('redis', '127.0.0.1:1', 'r'))\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "pip install 'redis>=4.5'" in out.stdout
