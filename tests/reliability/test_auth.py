"""Authentication everywhere it applies: the secret comes from a file or the
environment, the right one is accepted, a wrong or missing one is refused with
a clear error: TCPStore, ``rdzv serve`` and the c10d rendezvous; and the c10d
rendezvous and ``rdzv status`` over TLS, refusing a certificate they cannot
verify."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import rdzv
from rdzv.api import RendezvousParameters
from rdzv.auth import AUTH_TOKEN_ENV, read_token_file, resolve_auth_token
from rdzv.backends.store import create_backend
from rdzv.dynamic.handler import DynamicRendezvousHandler
from rdzv.errors import RendezvousConnectionError, StoreAuthenticationError
from rdzv.status_cli import EXIT_UNKNOWN_RUN
from rdzv.store.protocol import (
    AUTH_NONCE_BYTES,
    FEATURE_AUTH_REQUIRED,
    SERVER_AUTH_LABEL,
    SERVER_HELLO,
    AuthStatus,
    Request,
    RequestParser,
    auth_tag,
    encode_u8,
    encode_u32,
)
from rdzv.store.server import TCPStoreServer
from rdzv.store.tcp import TCPStore
from tests.certs import TLSFiles
from tests.procs import free_port, subprocess_env
from tests.reliability.sockets import served
from tests.store.helpers import serve_process

pytestmark = pytest.mark.timeout(60)

SECRET = "correct horse battery staple"


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(f"  {SECRET}\n")
    return path


# -- where the secret comes from ------------------------------------------------


def test_a_token_file_wins_over_the_environment(token_file: Path) -> None:
    assert resolve_auth_token(token_file, {AUTH_TOKEN_ENV: "other"}) == SECRET.encode()


def test_the_environment_is_read_without_a_file() -> None:
    assert resolve_auth_token(None, {AUTH_TOKEN_ENV: " from-env "}) == b"from-env"
    assert resolve_auth_token(None, {AUTH_TOKEN_ENV: "  "}) is None
    assert resolve_auth_token(None, {}) is None


def test_an_empty_or_missing_token_file_is_an_error_naming_it(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_token_file(empty)
    with pytest.raises(OSError, match="missing"):
        resolve_auth_token(tmp_path / "missing", {AUTH_TOKEN_ENV: "ignored"})


# -- TCPStore against an in-process server -----------------------------------------


@pytest.fixture
def auth_server() -> Iterator[TCPStoreServer]:
    server = TCPStoreServer("127.0.0.1", 0, auth_token=SECRET).start()
    try:
        yield server
    finally:
        server.stop()


def test_tcpstore_right_secret_is_served(auth_server: TCPStoreServer) -> None:
    assert served(auth_server.port, auth_token=SECRET)


@pytest.mark.parametrize(
    ("token", "message"),
    [("wrong", "refused auth_token"), (None, "needs a shared secret")],
    ids=["wrong", "missing"],
)
def test_tcpstore_wrong_or_missing_secret_is_refused(
    auth_server: TCPStoreServer, token: str | None, message: str
) -> None:
    with pytest.raises(StoreAuthenticationError, match=message):
        TCPStore("127.0.0.1", auth_server.port, timeout=5, auth_token=token)
    assert served(auth_server.port, auth_token=SECRET)


# -- rdzv serve ---------------------------------------------------------------------


@contextmanager
def serve(*args: str, env: dict[str, str] | None = None) -> Iterator[tuple[int, int]]:
    """Run ``rdzv serve`` with a secret on a free port; yield its pid and port."""
    with serve_process(*args, env=env, announces="(auth") as (proc, port):
        yield proc.pid, port


@pytest.mark.parametrize("source", ["file", "env"])
def test_rdzv_serve_takes_the_secret_from_a_file_or_the_environment(
    token_file: Path, source: str
) -> None:
    if source == "file":
        context = serve("--auth-token-file", str(token_file))
    else:
        context = serve(env=subprocess_env(**{AUTH_TOKEN_ENV: SECRET}))
    with context as (pid, port):
        assert SECRET not in Path(f"/proc/{pid}/cmdline").read_bytes().decode()
        assert served(port, auth_token=SECRET)
        with pytest.raises(StoreAuthenticationError, match="refused auth_token"):
            TCPStore("127.0.0.1", port, timeout=5, auth_token="wrong")
        with pytest.raises(StoreAuthenticationError, match="needs a shared secret"):
            TCPStore("127.0.0.1", port, timeout=5)


def test_rdzv_serve_has_no_option_taking_the_secret_itself() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "rdzv.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=30,
        check=True,
    )
    assert "--auth-token-file" in result.stdout
    assert "--auth-token " not in result.stdout
    assert "--auth-token\n" not in result.stdout


# -- the c10d rendezvous ------------------------------------------------------------


def _params(endpoint: str, **config: Any) -> RendezvousParameters:
    return RendezvousParameters(
        "c10d", endpoint, "authjob", 1, 1, local_addr="127.0.0.1", read_timeout=5, **config
    )


def test_c10d_rendezvous_runs_authenticated_from_a_token_file(
    token_file: Path, handlers: list[DynamicRendezvousHandler]
) -> None:
    port = free_port()
    handler = rdzv.create_handler(
        _params(f"127.0.0.1:{port}", is_host=True, auth_token_file=str(token_file))
    )
    assert isinstance(handler, DynamicRendezvousHandler)
    handlers.append(handler)
    info = handler.next_rendezvous()
    assert info.world_size == 1
    info.store.set("round-key", "v")  # the round store speaks through the authenticated client
    assert info.store.get("round-key") == b"v"
    # The hosted store refuses anyone without the secret.
    with pytest.raises(StoreAuthenticationError):
        TCPStore("127.0.0.1", port, timeout=5)
    assert served(port, auth_token=SECRET)


def test_c10d_backend_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(AUTH_TOKEN_ENV, SECRET)
    port = free_port()
    backend, store = create_backend(_params(f"127.0.0.1:{port}", is_host=True))
    try:
        with pytest.raises(StoreAuthenticationError):
            TCPStore("127.0.0.1", port, timeout=5)
        assert served(port, auth_token=SECRET)
    finally:
        backend.close()
        store.close()


@pytest.mark.parametrize("wrong", ["file", "missing"])
def test_c10d_backend_with_a_wrong_or_missing_secret_is_refused(
    auth_server: TCPStoreServer, tmp_path: Path, wrong: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(AUTH_TOKEN_ENV, raising=False)
    config: dict[str, object] = {"is_host": False}
    if wrong == "file":
        bad = tmp_path / "bad"
        bad.write_text("not the secret")
        config["auth_token_file"] = str(bad)
    with pytest.raises(StoreAuthenticationError, match="authentication"):
        create_backend(_params(f"127.0.0.1:{auth_server.port}", **config))


# -- rdzv status (the launcher's tools go through the same create_backend) ----------


def _status(
    port: int, conf: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "rdzv.cli",
            "status",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            "authjob",
            "--rdzv-conf",
            conf,
        ],
        capture_output=True,
        text=True,
        env=env or subprocess_env(),
        timeout=60,
        check=False,
    )


def test_rdzv_status_authenticates_from_a_conf_key_or_the_environment(token_file: Path) -> None:
    with serve("--auth-token-file", str(token_file)) as (_pid, port):
        # The store holds no run: an authenticated status reads it and says so.
        by_file = _status(port, f"auth_token_file={token_file},is_host=false")
        assert by_file.returncode == EXIT_UNKNOWN_RUN, by_file.stderr
        assert "the store holds no run" in by_file.stderr
        by_env = _status(port, "is_host=false", env=subprocess_env(**{AUTH_TOKEN_ENV: SECRET}))
        assert by_env.returncode == EXIT_UNKNOWN_RUN, by_env.stderr
        missing = _status(port, "is_host=false,read_timeout=3")
        assert missing.returncode != 0
        assert "needs a shared secret" in missing.stderr


# -- TLS on the c10d rendezvous and rdzv status ----------------------------------------


def _tls_conf(files: TLSFiles, host: bool, other_ca: bool = False) -> dict[str, Any]:
    ca = files.other_ca_cert if other_ca else files.ca_cert
    conf: dict[str, Any] = {"is_host": host, "ca_cert": ca}
    if host:
        conf.update(ssl_cert=files.server_cert, ssl_cert_key=files.server_key)
    return conf


@pytest.mark.slow
def test_c10d_rendezvous_runs_over_tls_with_a_secret(
    tls_files: TLSFiles, token_file: Path, handlers: list[DynamicRendezvousHandler]
) -> None:
    endpoint = f"127.0.0.1:{free_port()}"

    def params(host: bool) -> RendezvousParameters:
        return RendezvousParameters(
            "c10d",
            endpoint,
            "tlsjob",
            2,
            2,
            local_addr="127.0.0.1",
            read_timeout=5,
            auth_token_file=str(token_file),
            **_tls_conf(tls_files, host),
        )

    host = rdzv.create_handler(params(True))
    guest = rdzv.create_handler(params(False))
    assert isinstance(host, DynamicRendezvousHandler)
    assert isinstance(guest, DynamicRendezvousHandler)
    handlers += [host, guest]
    infos: dict[str, rdzv.RendezvousInfo] = {}
    thread = threading.Thread(target=lambda: infos.update(guest=guest.next_rendezvous()))
    thread.start()
    infos["host"] = host.next_rendezvous()
    thread.join(30)
    assert not thread.is_alive()
    assert sorted(info.rank for info in infos.values()) == [0, 1]
    infos["guest"].store.set("over-tls", "yes")
    assert infos["host"].store.get("over-tls") == b"yes"
    # A plaintext client gets nothing from the TLS store, and fails in bounded time.
    port = int(endpoint.rsplit(":", 1)[1])
    with pytest.raises(RendezvousConnectionError):
        TCPStore("127.0.0.1", port, timeout=2, auth_token=SECRET)


@pytest.fixture
def tls_host(
    tls_files: TLSFiles, handlers: list[DynamicRendezvousHandler]
) -> tuple[str, DynamicRendezvousHandler]:
    """A c10d handler hosting its store over TLS; its endpoint and itself."""
    endpoint = f"127.0.0.1:{free_port()}"
    host = rdzv.create_handler(_params(endpoint, **_tls_conf(tls_files, True)))
    assert isinstance(host, DynamicRendezvousHandler)
    handlers.append(host)
    return endpoint, host


def test_c10d_node_that_cannot_verify_the_store_is_refused(
    tls_files: TLSFiles, tls_host: tuple[str, DynamicRendezvousHandler]
) -> None:
    endpoint, _ = tls_host
    with pytest.raises(RendezvousConnectionError, match="certificate"):
        create_backend(_params(endpoint, **_tls_conf(tls_files, False, other_ca=True)))


def test_c10d_node_without_the_server_certificate_joins_as_a_client(
    tls_files: TLSFiles, tls_host: tuple[str, DynamicRendezvousHandler]
) -> None:
    endpoint, host = tls_host
    # is_host is inferred: the endpoint is local, but only the host has the certificate.
    backend, store = create_backend(_params(endpoint, ca_cert=tls_files.ca_cert))
    try:
        store.set("client-over-tls", "yes")
        assert host.store.get("client-over-tls") == b"yes"
    finally:
        backend.close()
        store.close()


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        ({"ssl_cert": "cert"}, "ssl_cert is set without ssl_cert_key"),
        ({"ssl_cert_key": "key"}, "ssl_cert_key is set without ssl_cert"),
        ({"ssl_cert": "cert", "ssl_cert_key": "key"}, "without ca_cert"),
        ({"ca_cert": "ca"}, "ca_cert is set .TLS on. but this node hosts the store"),
        ({"cacert": "missing"}, "cacert '.*missing' cannot be loaded"),
        ({"ca_cert": "ca", "ssl_cert": "cert", "ssl_cert_key": "missing"}, "ssl_cert_key '"),
    ],
    ids=["cert-alone", "key-alone", "no-ca", "host-without-cert", "missing-ca", "missing-key"],
)
def test_tls_settings_errors_name_the_key(
    tls_files: TLSFiles, tmp_path: Path, conf: dict[str, str], message: str
) -> None:
    paths = {"ca": tls_files.ca_cert, "cert": tls_files.server_cert, "key": tls_files.server_key}
    config = {k: paths.get(v, str(tmp_path / v)) for k, v in conf.items()}
    with pytest.raises(ValueError, match=message):
        create_backend(_params(f"127.0.0.1:{free_port()}", is_host=True, **config))


def test_rdzv_status_verifies_the_store_over_tls(tls_files: TLSFiles, token_file: Path) -> None:
    cert, key = tls_files.server_cert, tls_files.server_key
    with serve("--auth-token-file", str(token_file), "--tls-cert", cert, "--tls-key", key) as (
        _pid,
        port,
    ):
        ca = tls_files.ca_cert
        verified = _status(port, f"auth_token_file={token_file},is_host=false,ca_cert={ca}")
        assert verified.returncode == EXIT_UNKNOWN_RUN, verified.stderr  # read: holds no run
        assert "the store holds no run" in verified.stderr
        other = tls_files.other_ca_cert
        unverified = _status(
            port, f"auth_token_file={token_file},is_host=false,ca_cert={other},read_timeout=3"
        )
        assert unverified.returncode != 0
        assert "certificate" in unverified.stderr


def _requests(conn: socket.socket, parser: RequestParser, count: int) -> list[Request]:
    """Read ``count`` requests from ``conn``."""
    found: list[Request] = []
    while len(found) < count:
        request = parser.next_request()
        if request is not None:
            found.append(request)
            continue
        data = conn.recv(4096)
        assert data, "the client closed the connection"
        parser.feed(data)
    return found


def test_a_connection_cut_while_authenticating_is_retried_not_taken_for_a_refusal() -> None:
    # A server that reclaims a handshake (its slots full) cuts the connection
    # after the client sent its tag; that is connection trouble, and the
    # client's retry authenticates. It used to raise "refused auth_token".
    secret = SECRET.encode()
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    kept: list[socket.socket] = []

    def serve() -> None:
        for attempt in range(2):
            conn, _ = listener.accept()
            kept.append(conn)
            parser = RequestParser()
            _requests(conn, parser, 2)  # VALIDATE, PING
            conn.sendall(encode_u32(SERVER_HELLO | FEATURE_AUTH_REQUIRED))
            _requests(conn, parser, 1)  # AUTH_CHALLENGE
            server_nonce = os.urandom(AUTH_NONCE_BYTES)
            conn.sendall(server_nonce)
            (response,) = _requests(conn, parser, 1)
            if attempt == 0:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                conn.close()  # a reset, as the server's abort of a reclaimed handshake
                continue
            client_nonce = response.values[0]
            proof = auth_tag(secret, SERVER_AUTH_LABEL, server_nonce, client_nonce)
            conn.sendall(encode_u8(AuthStatus.OK) + proof)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        store = TCPStore("127.0.0.1", port, timeout=20, auth_token=SECRET)
        store.close()
        thread.join(20)
        assert len(kept) == 2  # cut once, then authenticated on the retry
    finally:
        listener.close()
        for conn in kept:
            conn.close()
