"""The TCPStore client: hosting, reconnecting, threads, auth and TLS."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import struct
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest

import rdzv
from rdzv.errors import RendezvousConnectionError, StoreAuthenticationError, StoreTimeoutError
from rdzv.retry import LAST_ATTEMPT, as_clock, deadline_within
from rdzv.store import link
from rdzv.store.protocol import (
    FEATURE_AUTH_REQUIRED,
    PROBE_NONCE,
    SERVER_HELLO,
    VALIDATE_MAGIC,
    Op,
    Request,
    RequestParser,
    encode_request,
)
from rdzv.store.server import TCPStoreServer
from rdzv.store.tcp import TCPStore
from rdzv.testing.clock import AutojumpClock
from tests.certs import TLSFiles, make_tls_files
from tests.procs import free_port
from tests.store.helpers import serve_process

pytestmark = pytest.mark.timeout(60)


def test_public_names() -> None:
    assert rdzv.TCPStore is TCPStore
    assert rdzv.TCPStoreServer is TCPStoreServer
    assert issubclass(rdzv.StoreAuthenticationError, rdzv.RendezvousError)


def test_master_hosts_a_server_on_afree_port() -> None:
    with TCPStore("127.0.0.1", 0, is_master=True, timeout=5) as master:
        assert master.port > 0
        assert master.host == "127.0.0.1"
        assert master.server is not None
        assert master.supports_watch
        with TCPStore("127.0.0.1", master.port, timeout=5) as worker:
            worker.set("from-worker", "hi")
        assert master.get("from-worker") == b"hi"
        server = master.server
    assert not server.running


def test_constructor_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="port 0"):
        TCPStore("127.0.0.1", 0)
    with pytest.raises(ValueError, match="65536"):
        TCPStore("127.0.0.1", 65536)
    with pytest.raises(ValueError, match="world_size"):
        TCPStore("127.0.0.1", 0, world_size=0, is_master=True)


def test_bad_keys_and_values_are_refused_before_sending() -> None:
    with TCPStore("127.0.0.1", 0, is_master=True, timeout=5) as store:
        with pytest.raises(ValueError, match="limit is 8192"):
            store.set("k" * 9000, "v")
        with pytest.raises(TypeError, match="str"):
            store.set(b"bytes-key", "v")  # type: ignore[arg-type]  # deliberately wrong type
        with pytest.raises(TypeError, match="not a single str"):
            store.wait("abc")
        store.set("still", "fine")
        assert store.get("still") == b"fine"


def test_world_size_waits_for_every_worker() -> None:
    port = free_port()
    errors: list[BaseException] = []
    workers: list[TCPStore] = []

    def worker() -> None:
        try:
            workers.append(TCPStore("127.0.0.1", port, world_size=3, timeout=10))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        with TCPStore("127.0.0.1", port, world_size=3, is_master=True, timeout=10) as master:
            for thread in threads:
                thread.join(20)
            assert errors == []
            assert master.num_keys() == 1  # torch's raw "init/" key
            assert master.list_keys() == []
    finally:
        for thread in threads:
            thread.join(20)
        for store in workers:
            store.close()


def test_world_size_times_out_when_workers_are_missing() -> None:
    with pytest.raises(StoreTimeoutError, match="1 of 2 workers"):
        TCPStore("127.0.0.1", 0, world_size=2, is_master=True, timeout=0.3)


def test_multi_tenant_masters_share_one_server() -> None:
    first = TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, timeout=5)
    try:
        second = TCPStore("127.0.0.1", first.port, is_master=True, multi_tenant=True, timeout=5)
        assert second.server is first.server
        first.set("shared", "yes")
        assert second.get("shared") == b"yes"
        server = first.server
        assert server is not None
        first.close()
        assert server.running
        assert second.get("shared") == b"yes"
        second.close()
        assert not server.running
    finally:
        first.close()


def test_connect_is_retried_until_the_server_appears() -> None:
    port = free_port()
    server = TCPStoreServer("127.0.0.1", port)
    starter = threading.Timer(0.4, server.start)
    starter.start()
    try:
        with TCPStore("127.0.0.1", port, timeout=10) as client:
            client.set("late", "server")
            assert client.get("late") == b"server"
    finally:
        starter.join()
        server.stop()


def test_connect_gives_up_after_the_timeout() -> None:
    port = free_port()
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match="could not connect"):
        TCPStore("127.0.0.1", port, timeout=0.5)
    assert time.monotonic() - started < 10


def test_connect_retries_and_gives_up_on_the_callers_clock() -> None:
    # A minute of backoff between refused connects passes on the autojump
    # clock; the real time it takes is only the connects' (the bound catches hangs).
    port = free_port()
    started = time.monotonic()
    with AutojumpClock() as clock, clock.running(), deadline_within(3600, clock):
        begin = clock()
        with pytest.raises(RendezvousConnectionError, match=r"could not connect .* within 60 s"):
            TCPStore("127.0.0.1", port, timeout=60)
        assert clock() - begin >= 60
    assert time.monotonic() - started < 30


def test_broken_connection_raises_then_the_next_call_reconnects() -> None:
    port = free_port()
    server = TCPStoreServer("127.0.0.1", port).start()
    client = TCPStore("127.0.0.1", port, timeout=10)
    outcome: list[BaseException] = []

    def blocked_wait() -> None:
        try:
            client.wait(["never"], 30)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=blocked_wait)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while server.waiter_count() == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        server.stop()
        thread.join(20)
        assert len(outcome) == 1
        assert isinstance(outcome[0], RendezvousConnectionError)
        server = TCPStoreServer("127.0.0.1", port).start()
        client.set("again", "1")
        assert client.get("again") == b"1"
    finally:
        thread.join(20)
        client.close()
        server.stop()


def test_clone_has_its_own_connection_so_a_blocked_call_does_not_stall_it() -> None:
    with TCPStore("127.0.0.1", 0, is_master=True, timeout=10) as store, store.clone() as other:
        assert other.server is None
        assert other.timeout == store.timeout
        result: list[bytes | None] = []
        thread = threading.Thread(target=lambda: result.append(store.watch("w", None, 10)))
        thread.start()
        try:
            assert store.server is not None
            deadline = time.monotonic() + 10
            while store.server.waiter_count() == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            other.set("w", "changed")
        finally:
            thread.join(20)
        assert result == [b"changed"]


def test_closed_client_refuses_calls() -> None:
    with TCPStore("127.0.0.1", 0, is_master=True, timeout=5) as store:
        pass
    with pytest.raises(RendezvousConnectionError, match="closed"):
        store.get("x")


def test_threads_share_one_client_safely() -> None:
    with TCPStore("127.0.0.1", 0, is_master=True, timeout=10) as store:

        def work(index: int) -> None:
            for i in range(100):
                store.add("counter", 1)
                store.set(f"t{index}", str(i))
                assert store.get(f"t{index}") == str(i).encode()

        threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert store.get("counter") == b"800"


# -- authentication ---------------------------------------------------------


@pytest.fixture
def auth_server() -> Iterator[TCPStoreServer]:
    server = TCPStoreServer("127.0.0.1", 0, auth_token="s3cret-token").start()
    try:
        with TCPStore("127.0.0.1", server.port, timeout=5, auth_token="s3cret-token") as owner:
            owner.set("private-key-name", "private-value")
        yield server
    finally:
        server.stop()


def test_right_secret_works(auth_server: TCPStoreServer) -> None:
    with TCPStore("127.0.0.1", auth_server.port, timeout=5, auth_token=b"s3cret-token") as client:
        assert client.get("private-key-name") == b"private-value"
        assert client.supports_watch


@pytest.mark.parametrize("token", [None, "wrong-token"], ids=["missing", "wrong"])
def test_missing_or_wrong_secret_is_refused(auth_server: TCPStoreServer, token: str | None) -> None:
    started = time.monotonic()
    with pytest.raises(StoreAuthenticationError, match="authentication") as info:
        TCPStore("127.0.0.1", auth_server.port, timeout=5, auth_token=token)
    assert "private" not in str(info.value)
    assert time.monotonic() - started < 4, "an auth failure must not be retried"


@pytest.mark.parametrize(
    "request_",
    [
        Request(Op.LIST_KEYS),
        Request(Op.GET, (b"/private-key-name",)),
        Request(Op.GETNUMKEYS),
        Request(Op.CHECK, (b"/private-key-name",)),
        Request(Op.SET, (b"/x",), (b"y",)),
    ],
    ids=lambda r: Op(r.op).name,
)
def test_nothing_is_served_before_authentication(
    auth_server: TCPStoreServer, request_: Request
) -> None:
    with socket.create_connection(("127.0.0.1", auth_server.port), timeout=5) as sock:
        sock.sendall(encode_request(Request(Op.VALIDATE, number=VALIDATE_MAGIC)))
        sock.sendall(encode_request(Request(Op.PING, number=PROBE_NONCE)))
        sock.sendall(encode_request(request_))
        received = b""
        while chunk := sock.recv(1024):
            received += chunk
    (hello,) = struct.unpack("<I", received[:4])
    assert hello == SERVER_HELLO | FEATURE_AUTH_REQUIRED
    assert received[4:] == b""
    with TCPStore("127.0.0.1", auth_server.port, timeout=5, auth_token="s3cret-token") as owner:
        assert not owner.check(["x"])


def test_forged_response_without_challenge_is_refused(auth_server: TCPStoreServer) -> None:
    with socket.create_connection(("127.0.0.1", auth_server.port), timeout=5) as sock:
        sock.sendall(encode_request(Request(Op.VALIDATE, number=VALIDATE_MAGIC)))
        sock.sendall(encode_request(Request(Op.AUTH_RESPONSE, (), (b"n" * 32, b"t" * 32))))
        assert sock.recv(16) == b""


def test_client_with_secret_refuses_a_server_without_auth() -> None:
    with (
        TCPStoreServer("127.0.0.1", 0) as server,
        pytest.raises(StoreAuthenticationError, match="does not require authentication"),
    ):
        TCPStore("127.0.0.1", server.port, timeout=5, auth_token="s3cret-token")


def test_master_with_secret_hosts_an_authenticating_server() -> None:
    with TCPStore("127.0.0.1", 0, is_master=True, timeout=5, auth_token="tok") as master:
        master.set("a", "b")
        with pytest.raises(StoreAuthenticationError):
            TCPStore("127.0.0.1", master.port, timeout=5)


# -- TLS -------------------------------------------------------------------


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    """A CA and a server certificate for 127.0.0.1 it signed."""
    return make_tls_files(tmp_path_factory.mktemp("tls"))


def contexts(files: TLSFiles) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(files.server_cert, files.server_key)
    client_context = ssl.create_default_context(cafile=files.ca_cert)
    return server_context, client_context


def test_tls_round_trip(certificate: TLSFiles) -> None:
    server_context, client_context = contexts(certificate)
    with TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        timeout=5,
        ssl_context=client_context,
        server_ssl_context=server_context,
        auth_token="tok",
    ) as master:
        master.set("tls", "on")
        with TCPStore(
            "127.0.0.1", master.port, timeout=5, ssl_context=client_context, auth_token="tok"
        ) as other:
            assert other.get("tls") == b"on"
            assert other.watch("tls", b"on", 0.05) == b"on"


def test_tls_client_refuses_an_unknown_certificate(certificate: TLSFiles) -> None:
    server_context, _ = contexts(certificate)
    with TCPStoreServer("127.0.0.1", 0, ssl_context=server_context) as server:
        with pytest.raises(RendezvousConnectionError, match="certificate"):
            TCPStore("127.0.0.1", server.port, timeout=5, ssl_context=ssl.create_default_context())
        with pytest.raises(RendezvousConnectionError):
            TCPStore("127.0.0.1", server.port, timeout=0.5)


class _RecordingSocket:
    """A client's socket that records every ``sendall`` and passes everything on."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sent: list[bytes] = []

    def sendall(self, data: bytes) -> None:
        self.sent.append(bytes(data))
        self.sock.sendall(data)

    def __getattr__(self, name: str) -> object:
        return getattr(self.sock, name)


def test_the_fast_frames_are_encode_requests(rdzv_server: TCPStoreServer) -> None:
    # set, get, add and compare_set encode their fields without a Request:
    # byte for byte the same requests, one sendall each.
    with TCPStore("127.0.0.1", rdzv_server.port, timeout=7) as store:
        store.set("frames/warm", b"")
        recorder = _RecordingSocket(store._link.sock)  # type: ignore[arg-type]
        store._link.sock = recorder  # type: ignore[assignment]
        store.set("frames/k", b"v" * 100)
        store.set("frames/s", "text é")
        assert store.get("frames/k") == b"v" * 100
        assert store.add("frames/n", -3) == -3
        assert store.compare_set("frames/k", b"v" * 100, b"w") == b"w"
        store.append("frames/s", b"!")
        assert recorder.sent == [
            encode_request(Request(Op.SET, (b"/frames/k",), (b"v" * 100,))),
            encode_request(Request(Op.SET, (b"/frames/s",), ("text é".encode(),))),
            encode_request(Request(Op.GET_WAIT, (b"/frames/k",), (), 7000)),
            encode_request(Request(Op.ADD, (b"/frames/n",), (), -3)),
            encode_request(Request(Op.COMPARE_SET, (b"/frames/k",), (b"v" * 100, b"w"))),
            encode_request(Request(Op.APPEND, (b"/frames/s",), (b"!",))),
        ]


def test_every_opcode_the_client_sends_is_what_encode_request_makes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sent: list[bytes] = []
    connect = socket.create_connection

    def recording(*args: object, **kwargs: object) -> _RecordingSocket:
        recorder = _RecordingSocket(connect(*args, **kwargs))  # type: ignore[arg-type]
        recorder.sent = sent
        return recorder

    monkeypatch.setattr(socket, "create_connection", recording)
    with (
        TCPStoreServer("127.0.0.1", 0, auth_token="tok") as server,
        TCPStore("127.0.0.1", server.port, timeout=5, auth_token="tok") as store,
    ):
        store.set("a", "1")
        store.append("a", "2")
        assert store.get("a") == b"12"
        assert store.add("n", 2) == 2
        assert store.compare_set("a", "12", "3") == b"3"
        assert store.check(["a"])
        store.wait(["a"])
        with pytest.raises(StoreTimeoutError):
            store.wait(["missing"], timeout=0.05)
        store.multi_set(["b", "c"], ["4", "5"])
        assert store.multi_get(["b", "c"]) == [b"4", b"5"]
        assert store.try_multi_get(["b", "missing"]) == [b"4", None]
        assert store.delete_key("c")
        assert store.num_keys() == 3
        assert sorted(store.list_keys()) == ["a", "b", "n"]
        store.queue_push("q", "x")
        assert store.queue_len("q") == 1
        assert store.queue_pop("q") == b"x"
        store.barrier("bar", 1)
        assert store.watch("a", None, 0.01) == b"3"
        assert store.watch("a", b"3", 0.01) == b"3"
        store.set_will("a", b"gone")
        store.set_will("a", None)
        store._link.rdzv_server = False  # get as on torch's server: WAIT, then GET
        assert store.get("a") == b"3"
    stream = b"".join(sent)
    parser = RequestParser()
    parser.feed(stream)
    requests = list(iter(parser.next_request, None))
    assert b"".join(map(encode_request, requests)) == stream
    assert {request.op for request in requests} == set(Op)


def test_an_add_out_of_range_is_a_value_error_that_sends_nothing(
    rdzv_server: TCPStoreServer,
) -> None:
    with TCPStore("127.0.0.1", rdzv_server.port, timeout=5) as store:
        before = store._link.sock
        with pytest.raises(ValueError, match="amount to add 9223372036854775808 does not fit"):
            store.add("frames/big", 1 << 63)
        assert store._link.sock is before  # the connection was kept
        assert store.add("frames/big", 1) == 1


class _TricklingSocket(_RecordingSocket):
    """A client's socket whose every ``recv`` returns at most one byte."""

    def recv(self, size: int) -> bytes:
        return self.sock.recv(min(size, 1))


@pytest.mark.parametrize("trickle", [False, True], ids=["whole", "one-byte-recvs"])
def test_replies_whole_or_cut_anywhere_read_the_same(
    rdzv_server: TCPStoreServer, trickle: bool
) -> None:
    # add, get and compare_set decode a reply that one recv brought whole
    # straight from it; cut anywhere, they read it from the buffer instead.
    with TCPStore("127.0.0.1", rdzv_server.port, timeout=0.3) as store:
        store.set("cut/warm", b"")
        sock = store._link.sock
        assert sock is not None
        if trickle:
            store._link.sock = _TricklingSocket(sock)  # type: ignore[assignment]
        current = store._link.sock
        assert store.add("cut/n", 5) == 5
        assert store.add("cut/n", -7) == -2
        store.set("cut/k", b"x" * 300)
        assert store.get("cut/k") == b"x" * 300
        assert store.get("cut/warm") == b""
        assert store.compare_set("cut/k", b"x" * 300, b"y") == b"y"
        assert store.compare_set("cut/k", b"nope", b"z") == b"y"
        with pytest.raises(StoreTimeoutError, match="cut/absent"):
            store.get("cut/absent")
        assert store._link.reader.pending == 0
        assert store.add("cut/n", 2) == 0  # still in step on the same connection
        assert store._link.sock is current


@pytest.mark.parametrize("timeout", [timedelta.max, 1e10, 366 * 24 * 3600 + 1])
def test_a_timeout_over_a_year_is_a_value_error_naming_it(
    rdzv_server: TCPStoreServer, timeout: timedelta | float
) -> None:
    # Such timeouts no longer fit the calls that carry them: they failed
    # with OverflowError, struct.error, or a "connection failed" that
    # dropped the connection.
    with pytest.raises(ValueError, match=r"at most 3.16224e\+07 s \(a year\)"):
        TCPStore("127.0.0.1", rdzv_server.port, timeout=timeout)
    with TCPStore("127.0.0.1", rdzv_server.port, timeout=5) as store:
        store.set("year/k", b"v")
        connection = store._link.sock
        for call in (
            lambda: store.wait(["year/k"], timeout),
            lambda: store.watch("year/k", None, timeout),
            lambda: store.set_timeout(timeout),
        ):
            with pytest.raises(ValueError, match="a year"):
                call()
        assert store._link.sock is connection
        assert store.get("year/k") == b"v"


@pytest.mark.parametrize("world_size", [0, -1, 1 << 63])
def test_a_barrier_of_an_impossible_size_is_a_value_error_that_sends_nothing(
    rdzv_server: TCPStoreServer, world_size: int
) -> None:
    with TCPStore("127.0.0.1", rdzv_server.port, timeout=5) as store:
        connection = store._link.sock
        with pytest.raises(
            ValueError, match=f"world_size must be in 1..2\\*\\*63-1, got {world_size}"
        ):
            store.barrier("bar/k", world_size, 0.1)
        assert store._link.sock is connection
        assert store.add(f"bar/n{world_size}", 1) == 1


def test_a_watch_a_paused_server_ends_late_is_answered_not_a_connection_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # At 8,192 simulated nodes on two busy cores the server ended watches
    # more than 5 s after their timeout, and the client gave up on them as
    # on a dead connection: the reply to a watch may take as long as any.
    monkeypatch.setattr(link, "_REPLY_GRACE", 0.2)
    with serve_process() as (proc, port):
        store = TCPStore("127.0.0.1", port, timeout=2.0)  # any reply within 2.2 s
        store.set("k", b"v")

        def pause() -> None:
            time.sleep(0.05)  # the watch is on its way or registered
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                time.sleep(1.5)  # far past the watch's 0.5 s and the old 0.2 s grace
            finally:
                os.kill(proc.pid, signal.SIGCONT)

        pauser = threading.Thread(target=pause)
        pauser.start()
        try:
            assert store.watch("k", b"v", 0.5) == b"v"
        finally:
            pauser.join()
        assert store.get("k") == b"v"  # the connection stayed in step
        store.close()


def test_a_call_under_a_callers_deadline_ends_by_it_against_a_paused_server() -> None:
    # The handler and its keep-alive call under a deadline; before the client
    # honoured it, a paused server cost each call the store timeout plus grace.
    with serve_process() as (proc, port):
        store = TCPStore("127.0.0.1", port, timeout=30.0)
        store.set("k", b"v")
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            for call in (lambda: store.get("k"), lambda: store.add("n", 1)):
                started = time.monotonic()
                with deadline_within(1.0), pytest.raises(RendezvousConnectionError):
                    call()
                assert time.monotonic() - started < 1.0 + 10.0  # 35 s before
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert store.get("k") == b"v"  # connected again; nothing was lost
        store.close()


def test_a_wait_a_callers_deadline_cuts_short_is_cancelled_in_step() -> None:
    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=30.0)
    try:
        connection = store._link.sock
        started = time.monotonic()
        with deadline_within(0.3), pytest.raises(StoreTimeoutError, match="timed out after"):
            store.wait(["absent"], timedelta(seconds=30))
        assert time.monotonic() - started < 0.3 + 10.0
        assert store._link.sock is connection  # cancelled, not dropped
        store.set("absent", b"here")
        store.wait(["absent"], timedelta(seconds=30))
    finally:
        store.close()


def test_the_callers_deadline_caps_a_limit_in_steps() -> None:
    now = [100.0]
    assert link.capped(65.0) == 65.0  # no deadline
    with deadline_within(120.0, as_clock(lambda: now[0])):
        assert link.capped(65.0) == 65.0  # the deadline is farther
        now[0] += 1.0  # 119 s left: rounded down to a step of 8 s
        assert link.capped(125.0) == 112.0
        now[0] += 99.0  # 20 s left: a step of 2 s
        assert link.capped(65.0) == 20.0
        now[0] += 0.6  # 19.4 s left
        assert link.capped(65.0) == 18.0
        now[0] += 16.0  # 3.4 s left: the finest step, 0.25 s
        assert link.capped(65.0) == 3.25
        assert link.capped(0.1) == 0.1  # never above the limit asked for
        now[0] += 30.0  # past it: a last attempt
        assert link.capped(65.0) == LAST_ATTEMPT
