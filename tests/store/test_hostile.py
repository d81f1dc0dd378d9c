"""The store server under hostile clients: each attack of issue #14, scaled
down to seconds, on real loopback sockets, asserting the bound it must stay
within (the server's memory growth and CPU, the connection refused with a log
line, a well-behaved client still served quickly), not just survival.

Bounds on time are generous: these tests share two cores with other work.
"""

from __future__ import annotations

import json
import logging
import ssl
import struct
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import pytest

from rdzv.errors import RendezvousConnectionError, StoreAuthenticationError
from rdzv.store.engine import (
    DEFAULT_MAX_WAITED_KEYS,
    DEFAULT_MAX_WAITING_BYTES,
    MAX_APPENDED_BYTES,
    MAX_REPLY_BYTES,
    WAITED_KEY_OVERHEAD,
)
from rdzv.store.protocol import MAX_MULTI_KEYS, Op, Request, encode_bytes, encode_request
from rdzv.store.server import TCPStoreServer
from rdzv.store.tcp import TCPStore
from tests.certs import TLSFiles
from tests.procs import wait_until
from tests.store.hostile import (
    VALIDATE,
    ServerProcess,
    attacker,
    closed_by_server,
    latencies,
    quantile,
    send_quietly,
    server_process,
    waiting_attack_process,
)

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
RSS_BOUND = 64 * MiB
"""The issue's bound on the server's memory growth under each attack."""
LATENCY_BOUND = 0.5
"""Seconds: a well-behaved client's median set+get must stay well under a
second during an attack (it is a millisecond on a quiet machine; before the
fixes, the slow-frame attack made it seconds)."""
SECRET = "hostile-test-secret"


def _incomplete_check(keys: int) -> bytes:
    """A CHECK of ``keys`` empty keys (8 bytes each on the wire), its last 100 bytes missing."""
    frame = encode_request(Request(Op.CHECK, (b"",) * keys))
    return frame[:-100]


@pytest.mark.slow
def test_slow_incomplete_requests_cost_little_cpu_and_others_are_served(tmp_path: Path) -> None:
    # Row 1: connections each hold a 1 MiB incomplete CHECK of 131,072 keys
    # and add one byte every 50 ms. A parser that re-read the request on
    # every byte spent ~100 ms per byte per connection and starved the loop.
    with server_process(tmp_path) as server, ExitStack() as stack:
        socks = [stack.enter_context(attacker(server.port)) for _ in range(8)]
        for sock in socks:
            assert send_quietly(sock, VALIDATE + _incomplete_check(MAX_MULTI_KEYS))
        stop = threading.Event()

        def drip() -> None:
            for _ in range(90):  # 90 bytes per connection: the frame never completes
                if stop.wait(0.05):
                    return
                for sock in socks:
                    send_quietly(sock, b"\x00")

        dripper = threading.Thread(target=drip)
        cpu_before = server.cpu()
        started = time.monotonic()
        dripper.start()
        try:
            taken = latencies(server.port, seconds=3.0)
        finally:
            stop.set()
            dripper.join(30)
        elapsed = time.monotonic() - started
        cpu = server.cpu() - cpu_before
    assert quantile(taken, 0.5) < LATENCY_BOUND, taken
    assert cpu < 0.5 * elapsed, (cpu, elapsed)


def test_a_store_request_before_authenticating_is_refused_at_its_opcode(tmp_path: Path) -> None:
    # Row 2: connections that never authenticate each start an 8 MiB value.
    # The SET's opcode byte ends the connection: nothing of it is buffered.
    header = b"\x01" + encode_bytes(b"/big") + struct.pack("<Q", 8 * MiB)
    with server_process(tmp_path, auth_token=SECRET) as server, ExitStack() as stack:
        idle_rss = server.rss()
        socks = [stack.enter_context(attacker(server.port)) for _ in range(50)]
        for sock in socks:
            send_quietly(sock, VALIDATE + header + b"x" * MiB)
        assert all(closed_by_server(sock) for sock in socks)
        grown = server.rss() - idle_rss
        taken = latencies(server.port, 1.0, auth_token=SECRET)
        log = server.log()
    assert grown < RSS_BOUND, grown
    assert quantile(taken, 0.5) < LATENCY_BOUND, taken
    assert "sent opcode 1 and was disconnected: it sent a request before authenticating" in log


def _shed_in_turn(
    server: ServerProcess, stack: ExitStack, payload: bytes, count: int, gap: float
) -> tuple[int, list[bool]]:
    """Send ``payload`` (an incomplete request) on ``count`` connections, ``gap`` s apart.

    Waits for the server to shed some (its ``max_buffered_bytes`` log line).
    The connections stay open until ``stack`` closes.

    Returns:
        The server's RSS growth, and which connections it closed, oldest first.
    """
    idle_rss = server.rss()
    socks = []
    for _ in range(count):
        sock = stack.enter_context(attacker(server.port))
        send_quietly(sock, payload)
        socks.append(sock)
        time.sleep(gap)  # each one's request starts later than the one before
    wait_until(lambda: "max_buffered_bytes" in server.log())
    grown = server.rss() - idle_rss
    for sock in socks:
        sock.settimeout(2.0)  # a loaded server sheds the next ones a little later
    return grown, [closed_by_server(sock) for sock in socks]


@pytest.mark.slow
def test_without_a_secret_incomplete_requests_are_bounded_in_total(tmp_path: Path) -> None:
    # Row 2 without a secret: VALIDATE is the whole handshake, so the 8 MiB
    # values are read; past max_buffered_bytes in total, the connections
    # whose requests have been arriving the longest are closed.
    header = b"\x01" + encode_bytes(b"/big") + struct.pack("<Q", 8 * MiB)
    with server_process(tmp_path, max_buffered_bytes=16 * MiB) as server, ExitStack() as stack:
        payload = VALIDATE + header + b"x" * (4 * MiB)
        grown, closed = _shed_in_turn(server, stack, payload, 8, 0.2)
        taken = latencies(server.port, 1.0)
    assert grown < RSS_BOUND, grown
    assert closed[:4] == [True] * 4, closed  # the oldest went first ...
    assert closed[-1] is False, closed  # ... and the newest is still being read
    assert quantile(taken, 0.5) < LATENCY_BOUND, taken


@pytest.mark.slow
def test_without_a_secret_keys_decoded_from_incomplete_requests_count_at_their_memory_cost(
    tmp_path: Path,
) -> None:
    # Incomplete CHECKs of 1-byte keys: 1.1 MiB on the wire each, about five
    # times that once decoded. Counted by wire bytes, six of them (6.8 MiB)
    # stayed under a 16 MiB total while holding about 40 MiB; counted at their
    # memory cost, the oldest are closed, and what a closed one held is freed
    # at once (its parser referred back to its connection, so it lingered
    # until a garbage collection: the server grew 44 MiB here).
    frame = encode_request(Request(Op.CHECK, (b"k",) * MAX_MULTI_KEYS))[:-100]
    limit = 16 * MiB
    with server_process(tmp_path, max_buffered_bytes=limit) as server, ExitStack() as stack:
        grown, closed = _shed_in_turn(server, stack, VALIDATE + frame, 6, 0.3)
    assert grown < 2 * limit, grown  # 44 MiB when a shed connection's keys lingered
    assert closed[:3] == [True] * 3, closed  # the oldest went first ...
    assert closed[-1] is False, closed  # ... and the newest is still being read


def test_a_request_before_validate_is_refused_at_its_first_byte(
    make_server: type[TCPStoreServer], caplog: pytest.LogCaptureFixture
) -> None:
    server = make_server("127.0.0.1", 0).start()
    with attacker(server.port) as sock, caplog.at_level(logging.WARNING):
        sock.sendall(b"\x06")  # the first byte of a WAIT, nothing more
        assert closed_by_server(sock)
    assert "its first request was not VALIDATE" in caplog.text


@pytest.mark.slow
def test_a_client_that_never_reads_cannot_pile_up_replies(tmp_path: Path) -> None:
    # Row 3: small GETs of a 1 MiB value, never read: the server stops
    # executing them once 1 MiB of replies is unsent.
    get_big = encode_request(Request(Op.GET, (b"/big",)))
    with server_process(tmp_path, frame_timeout=5.0) as server:
        with TCPStore("127.0.0.1", server.port, timeout=30) as client:
            client.set("big", b"x" * MiB)
            assert client.check(["big"])  # acknowledged: the set was applied
        idle_rss = server.rss()
        with attacker(server.port, rcvbuf=4096) as lazy:
            lazy.sendall(VALIDATE + get_big * 300)  # 4 KB asking for 300 MiB
            time.sleep(1.0)
            grown = server.rss() - idle_rss
            taken = latencies(server.port, 1.0)
            # ... and it is dropped after frame_timeout (it still reads nothing).
            wait_until(lambda: "did not read its replies" in server.log(), timeout=30)
    assert grown < RSS_BOUND, grown
    assert quantile(taken, 0.5) < LATENCY_BOUND, taken


def test_a_multi_get_whose_reply_is_too_large_is_refused_naming_the_limit(
    tmp_path: Path,
) -> None:
    # Row 3: one 24 KB MULTI_GET naming a 1 MiB key 2,000 times (2 GiB of reply).
    multi_get = encode_request(Request(Op.MULTI_GET, (b"/big",) * 2000))
    with server_process(tmp_path) as server:
        with TCPStore("127.0.0.1", server.port, timeout=30) as client:
            client.set("big", b"x" * MiB)
            assert client.check(["big"])  # acknowledged: the set was applied
            idle_rss = server.rss()
            with attacker(server.port) as sock:
                sock.sendall(VALIDATE + multi_get)
                assert closed_by_server(sock), server.log()
            grown = server.rss() - idle_rss
            assert client.get("big") == b"x" * MiB  # others are still served
        log = server.log()
    assert grown < RSS_BOUND, grown
    assert f"over the limit of {MAX_REPLY_BYTES} bytes (MAX_REPLY_BYTES)" in log


def test_writes_to_a_key_cost_one_step_per_waiter_on_it(
    make_server: type[TCPStoreServer],
) -> None:
    # Row 4: 8 WAITs of many keys, then 100 SET/DELETE pairs on one of them.
    server = make_server("127.0.0.1", 0).start()
    keys = (b"/hot", *(b"/absent-%06d" % i for i in range(16384)))
    with ExitStack() as stack:
        for _ in range(8):
            sock = stack.enter_context(attacker(server.port))
            sock.sendall(VALIDATE + encode_request(Request(Op.WAIT, keys)))
        wait_until(lambda: server.waiter_count() == 8)
        checks_before = server.engine.waiter_checks
        with TCPStore("127.0.0.1", server.port, timeout=30) as client:
            for _ in range(100):
                client.set("hot", "1")
                client.delete_key("hot")
            assert client.add("done", 1) == 1  # acknowledged: every write was applied
        work = server.engine.waiter_checks - checks_before
    assert work <= 8 * 200, work  # one step per waiter per write, not per key it names


def test_waits_of_many_keys_stay_within_the_waiting_budget(tmp_path: Path) -> None:
    # Row 4: 8 WAITs of as many keys as one client may wait on, then SET/DELETE pairs.
    keys = (b"/hot", *(b"/absent-%07d" % i for i in range(DEFAULT_MAX_WAITED_KEYS - 1)))
    wait = VALIDATE + encode_request(Request(Op.WAIT, keys))
    held = sum(len(key) + WAITED_KEY_OVERHEAD for key in keys)
    admitted = DEFAULT_MAX_WAITING_BYTES // held
    assert 0 < admitted < 8  # the default lets some through and refuses the rest
    with server_process(tmp_path) as server, ExitStack() as stack:
        idle_rss = server.rss()
        socks = [stack.enter_context(attacker(server.port)) for _ in range(8)]
        for sock in socks:
            send_quietly(sock, wait)
        refusals = f"over the limit of {DEFAULT_MAX_WAITING_BYTES} bytes (max_waiting_bytes)"
        wait_until(
            lambda: server.log().count(refusals) == 8 - admitted, timeout=60, detail=server.log
        )
        with TCPStore("127.0.0.1", server.port, timeout=30) as client:
            for _ in range(100):
                client.set("/hot", "1")
                client.delete_key("/hot")
            grown = server.rss() - idle_rss
            assert client.add("done", 1) == 1  # others are still served
        for sock in socks:
            sock.settimeout(1)
        assert sum(closed_by_server(sock) for sock in socks) == 8 - admitted
    assert grown < RSS_BOUND, grown


WAIT_ATTACK_P99_BOUND = 0.1
"""Seconds: a well-behaved client's p99 during the ``WAIT`` attack. The
issue's bound is 50 ms (it was 206 ms, the server holding its loop for a
whole ``WAIT`` at a time); this one is twice that, for a loaded machine
(measured: 22 to 29 ms at a load average of 7, the old server 225 ms and
more), which the old server still misses by far."""


@pytest.mark.slow
def test_a_client_is_served_quickly_while_waits_of_many_keys_come_and_go(tmp_path: Path) -> None:
    # Issue 51 part 6a: rounds of eight WAITs of 65,536 keys each (as many
    # as one client may wait on), SET/DELETE pairs on a waited key, then the
    # waiters' connections closed. Registering and removing such a WAIT
    # took the loop for tens of milliseconds in one step (p99 225-1,470 ms
    # here); in slices, and with parsing in 16 KiB slices, every other
    # client waits a few milliseconds per turn. The bound also allows for
    # the machine's own noise: the baseline p99, measured in the same run.
    with server_process(tmp_path) as server:
        baseline = latencies(server.port, 1.0)
        with waiting_attack_process(server.port, 5.0, DEFAULT_MAX_WAITED_KEYS) as child:
            time.sleep(0.3)  # the first round's WAITs are arriving
            taken = latencies(server.port, 4.0)
            assert child.stdout is not None
            counts = json.loads(child.stdout.readline())
        log = server.log()
    assert counts["rounds"] >= 3, counts
    assert "max_waiting_bytes" in log  # some of each round's WAITs are held
    bound = WAIT_ATTACK_P99_BOUND + quantile(baseline, 0.99)
    assert quantile(taken, 0.99) < bound, (quantile(taken, 0.99), bound, taken[-10:])


def test_a_wait_of_more_keys_than_one_client_may_wait_on_is_refused_at_its_count(
    tmp_path: Path,
) -> None:
    # The issue's own size, 131,072 keys: the connection is closed once the
    # count is read, before the keys are (the log names the limit).
    head = VALIDATE + bytes([Op.WAIT]) + struct.pack("<Q", MAX_MULTI_KEYS)
    with server_process(tmp_path) as server:
        with attacker(server.port) as sock:
            send_quietly(sock, head)
            assert closed_by_server(sock)
        assert served_once_without_secret(server.port)
        log = server.log()
    assert f"WAIT of {MAX_MULTI_KEYS} keys is over the limit of {DEFAULT_MAX_WAITED_KEYS}" in log
    assert "(max_waited_keys)" in log


def served_once_without_secret(port: int) -> bool:
    """Whether a client is served one set + get."""
    with TCPStore("127.0.0.1", port, timeout=30) as store:
        store.set("after", "x")
        return store.get("after") == b"x"


def test_appends_stop_at_the_cap_naming_it_and_cost_linear_time(tmp_path: Path) -> None:
    # Row 5: repeated 32 KiB APPENDs to one key.
    chunk = b"a" * (32 * 1024)
    with server_process(tmp_path) as server:
        idle_rss = server.rss()
        cpu_before = server.cpu()
        with TCPStore("127.0.0.1", server.port, timeout=30) as client:
            for _ in range(MAX_APPENDED_BYTES // len(chunk)):
                client.append("grown", chunk)
            assert client.check(["grown"])  # acknowledged: every append was applied
            client.append("grown", chunk)  # one too many: the server hangs up
            with pytest.raises(RendezvousConnectionError):
                client.check(["grown"])
        cpu = server.cpu() - cpu_before
        with TCPStore("127.0.0.1", server.port, timeout=30) as reader:
            assert len(reader.get("grown")) == MAX_APPENDED_BYTES
        grown = server.rss() - idle_rss
        log = server.log()
    assert f"over the limit of {MAX_APPENDED_BYTES} bytes (MAX_APPENDED_BYTES)" in log
    assert cpu < 5.0, cpu  # 256 appends of 32 KiB: linear; quadratic copying took minutes
    assert grown < RSS_BOUND, grown


def test_the_connection_cap_follows_the_open_file_limit_and_refusals_do_not_flood_the_log(
    tmp_path: Path,
) -> None:
    # Row 6: more idle connections than the open-file limit allows.
    with server_process(tmp_path, nofile=256) as server, ExitStack() as stack:
        opened = 0
        for _ in range(400):
            sock = stack.enter_context(attacker(server.port, source="127.0.0.2"))
            if send_quietly(sock, VALIDATE):
                opened += 1
        taken = latencies(server.port, 1.0)  # from 127.0.0.1: a slot is left for it
        log = server.log()
    assert quantile(taken, 0.5) < LATENCY_BOUND, taken
    assert "max_connections=4096 lowered to" in log
    assert "refused" in log
    assert "Too many open files" not in log
    assert len(log.splitlines()) < 20, log  # throttled: not one line per refusal


@pytest.mark.slow
def test_a_client_is_served_while_idle_connections_hold_every_descriptor(tmp_path: Path) -> None:
    # Issue 51 part 6b: 1,100 connections from eight addresses (so no
    # per-address cap stops them) send VALIDATE and nothing more, under an
    # open-file limit of 1,024: every connection slot the limit leaves is
    # theirs. A client was refused until they left; now the oldest unused
    # one is closed to give it a slot, with one log line.
    with server_process(tmp_path, nofile=1024) as server, ExitStack() as stack:
        for i in range(1100):
            sock = stack.enter_context(attacker(server.port, source=f"127.0.0.{2 + i % 8}"))
            send_quietly(sock, VALIDATE)
        wait_until(  # every slot is taken
            lambda: "refused" in server.log() or "to give" in server.log(), detail=server.log
        )
        taken = latencies(server.port, 1.0, timeout=10)
        log = server.log()
    assert quantile(taken, 0.5) < LATENCY_BOUND, taken
    assert log.count("disconnected to give") == 1, log
    assert "it had sent nothing since its handshake" in log


def test_disconnects_before_the_handshake_do_not_flood_the_log(tmp_path: Path) -> None:
    # Row 1 with a secret: each connection is closed at its CHECK opcode
    # byte, and a peer repeats that as fast as it connects. So are a bad
    # VALIDATE and a wrong secret. One line per kind and log interval, not
    # one per connection (the 60 s attack on a rendezvous wrote 16,000).
    bad_magic = b"\x00" + (0x12345678).to_bytes(4, "little")
    sends = [_incomplete_check(1000), VALIDATE + _incomplete_check(1000), bad_magic] * 60
    with server_process(tmp_path, auth_token=SECRET) as server:
        for data in sends:
            with attacker(server.port) as sock:
                send_quietly(sock, data)
                assert closed_by_server(sock)
        for _ in range(20):
            with pytest.raises(StoreAuthenticationError):
                TCPStore("127.0.0.1", server.port, timeout=5, auth_token="wrong")
        assert served_once(server.port)
        lines = server.log().splitlines()
    assert len(lines) <= 8, lines
    # A request before VALIDATE or before authenticating: one kind.
    assert sum("sent opcode 5 and was disconnected" in line for line in lines) == 1, lines
    assert any("bad VALIDATE magic" in line for line in lines), lines
    assert any("authentication failed" in line for line in lines), lines


def test_an_open_connections_disconnect_is_logged_every_time(tmp_path: Path) -> None:
    # Past the handshake the peer is a client of the job: each of its
    # disconnects is worth its own line.
    challenge = encode_request(Request(Op.AUTH_CHALLENGE))
    with server_process(tmp_path) as server:
        for _ in range(3):
            with attacker(server.port) as sock:
                send_quietly(sock, VALIDATE + challenge)  # no secret: no authentication
                assert closed_by_server(sock)
        lines = server.log().splitlines()
    assert sum("sent opcode 64 and was disconnected" in line for line in lines) == 3, lines


def served_once(port: int) -> bool:
    """Whether an authenticated client is served one set + get."""
    with TCPStore("127.0.0.1", port, timeout=30, auth_token=SECRET) as store:
        store.set("after", "x")
        return store.get("after") == b"x"


@pytest.mark.slow
def test_unauthenticated_connections_cannot_take_an_authenticated_clients_slot(
    make_server: type[TCPStoreServer], caplog: pytest.LogCaptureFixture
) -> None:
    # Row 7 with a secret: idle sockets that never authenticate only ever
    # hold handshake slots; a newcomer is refused while they are young and
    # takes the oldest one's once it is past the grace.
    server = make_server(
        "127.0.0.1", 0, auth_token=SECRET, max_connections=16, max_handshakes=8
    ).start()
    with ExitStack() as stack, caplog.at_level(logging.WARNING):
        for _ in range(40):
            sock = stack.enter_context(attacker(server.port))
            send_quietly(sock, VALIDATE)
        wait_until(lambda: server.reclaimed_connections + server.refused_connections >= 32)
        assert server.connection_count() <= 8
        taken = latencies(server.port, 1.0, auth_token=SECRET)
    assert quantile(taken, 0.5) < LATENCY_BOUND, taken
    assert "max_handshakes" in caplog.text


def test_a_storm_of_real_clients_connects_without_reclaiming_each_other(
    make_server: type[TCPStoreServer],
) -> None:
    # Every agent of a large job connects at once: with more of them than
    # handshake slots, young handshakes are kept and newcomers retry, so no
    # real client's handshake is cut (before the grace, each newcomer closed
    # the oldest and they closed each other's faster than any finished).
    server = make_server("127.0.0.1", 0, auth_token=SECRET, max_handshakes=2).start()
    clients: list[TCPStore] = []
    guard = threading.Lock()

    def connect() -> None:
        store = TCPStore("127.0.0.1", server.port, timeout=60, auth_token=SECRET)
        with guard:
            clients.append(store)

    threads = [threading.Thread(target=connect) for _ in range(48)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert len(clients) == 48
        assert server.reclaimed_connections == 0
        wait_until(lambda: server.connection_count() == 48)
    finally:
        for store in clients:
            store.close()


def test_unauthenticated_connections_expire_after_the_handshake_timeout(
    make_server: type[TCPStoreServer],
) -> None:
    server = make_server("127.0.0.1", 0, auth_token=SECRET, handshake_timeout=0.5).start()
    with attacker(server.port) as sock:
        sock.sendall(VALIDATE)
        assert closed_by_server(sock)
    assert server.expired_connections == 1


def test_without_a_secret_one_address_cannot_take_every_slot(
    make_server: type[TCPStoreServer], caplog: pytest.LogCaptureFixture
) -> None:
    # Row 7 without a secret: VALIDATE is the whole handshake, so idle
    # connections are kept (torch's clients idle for a whole job); one
    # address may hold three quarters of the slots.
    server = make_server("127.0.0.1", 0, max_connections=20).start()
    with ExitStack() as stack, caplog.at_level(logging.WARNING):
        held = []
        for _ in range(40):
            sock = stack.enter_context(attacker(server.port, source="127.0.0.2"))
            send_quietly(sock, VALIDATE)
            held.append(sock)
        wait_until(lambda: server.refused_connections == 25)
        assert server.connection_count() == 15
        taken = latencies(server.port, 1.0)  # from 127.0.0.1
        time.sleep(0.5)
        assert server.connection_count() == 15  # the idle ones are kept
    assert quantile(taken, 0.5) < LATENCY_BOUND, taken
    assert "max_connections_per_address=15" in caplog.text


def test_tls_handshakes_in_progress_count_and_expire(
    make_server: type[TCPStoreServer], tls_files: TLSFiles
) -> None:
    # Row 8: TCP connections to a TLS store that never start the TLS handshake.
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tls_files.server_cert, tls_files.server_key)
    server = make_server(
        "127.0.0.1", 0, ssl_context=context, max_handshakes=8, handshake_timeout=1.0
    ).start()
    client_context = ssl.create_default_context(cafile=tls_files.ca_cert)
    with ExitStack() as stack:
        socks = [stack.enter_context(attacker(server.port)) for _ in range(40)]
        wait_until(lambda: server.reclaimed_connections + server.refused_connections >= 32)
        assert server.connection_count() <= 8
        taken = latencies(server.port, 1.0, ssl_context=client_context)
        assert all(closed_by_server(sock) for sock in socks)  # reclaimed or expired
    assert quantile(taken, 0.5) < LATENCY_BOUND, taken
    wait_until(lambda: server.connection_count() == 0)
