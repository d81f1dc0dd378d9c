"""Helpers of the hostile-client tests and benchmarks/hostile_bench.py: a
store server in a subprocess whose memory and CPU can be read, raw attacker
sockets, and a well-behaved client whose latency is measured while an attack
runs. The reliability and fuzz tests use its raw-socket helpers too."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from pathlib import Path
from typing import Any

from rdzv.store.protocol import MAX_MULTI_KEYS, VALIDATE_MAGIC, Op, Request, encode_request
from rdzv.store.tcp import TCPStore
from tests.engines.servers import stop_process
from tests.procs import cpu_seconds, rss_bytes, subprocess_env

VALIDATE = encode_request(Request(Op.VALIDATE, number=VALIDATE_MAGIC))

_SERVER = """
import json, logging, resource, sys
from rdzv.net import server_tls_context
from rdzv.store.server import TCPStoreServer

logging.basicConfig(level=logging.WARNING)
options = json.loads(sys.argv[1])
nofile = options.pop("nofile", None)
if nofile is not None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
tls = options.pop("tls", None)
context = None if tls is None else server_tls_context(*tls)
server = TCPStoreServer("127.0.0.1", 0, ssl_context=context, **options)
server.serve(lambda s: print(s.port, flush=True))
"""


class ServerProcess:
    """A :class:`~rdzv.store.server.TCPStoreServer` serving in a subprocess.

    Its log (warnings go to stderr) is written to a file, so a flood of log
    lines can neither block it nor be missed.
    """

    def __init__(self, proc: subprocess.Popen[str], port: int, log: Path) -> None:
        self.proc = proc
        self.port = port
        self._log = log

    def rss(self) -> int:
        """Return the server's resident memory in bytes."""
        return rss_bytes(self.proc.pid)

    def cpu(self) -> float:
        """Return the CPU seconds (user and system) the server has used."""
        return cpu_seconds(self.proc.pid)

    def log(self) -> str:
        """Return what the server logged so far."""
        return self._log.read_text()


@contextmanager
def server_process(tmp_path: Path, **options: Any) -> Iterator[ServerProcess]:
    """Run a store server in a subprocess with ``options``; stop it (by pid) at the end.

    ``nofile`` sets the server's open-file limit; ``tls`` is a (cert, key) pair.
    """
    log = tmp_path / f"server-{uuid.uuid4().hex[:8]}.log"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER, json.dumps(options)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=subprocess_env(),
        )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip().isdigit(), (line, log.read_text())
        yield ServerProcess(proc, int(line), log)
    finally:
        stop_process(proc, grace=15.0)
        if proc.stdout is not None:
            proc.stdout.close()


def attacker(
    port: int, source: str = "127.0.0.1", rcvbuf: int | None = None, timeout: float = 15
) -> socket.socket:
    """Open a raw connection to the server from ``source`` (any 127/8 address)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def send_quietly(sock: socket.socket, data: bytes) -> bool:
    """Send ``data``; return False if the server closed the connection meanwhile."""
    try:
        sock.sendall(data)
    except OSError:
        return False
    return True


def closed_by_server(sock: socket.socket) -> bool:
    """Block (up to the socket timeout) until the server closes ``sock``; read what comes."""
    try:
        while chunk := sock.recv(65536):
            del chunk
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def latencies(
    port: int, seconds: float, auth_token: str | None = None, timeout: float = 30, **client: Any
) -> list[float]:
    """Time ``set`` + ``get`` round trips of a fresh client for ``seconds``; sorted."""
    key = f"probe-{uuid.uuid4().hex}"
    taken: list[float] = []
    with TCPStore("127.0.0.1", port, timeout=timeout, auth_token=auth_token, **client) as store:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline or len(taken) < 5:
            started = time.perf_counter()
            store.set(key, "x")
            assert store.get(key) == b"x"
            taken.append(time.perf_counter() - started)
            time.sleep(0.01)
    return sorted(taken)


def quantile(sorted_values: list[float], q: float) -> float:
    """Return the ``q`` quantile of already sorted values (none: IndexError)."""
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def slow_check_frame(keys: int, missing: int = 1000) -> bytes:
    """A CHECK of ``keys`` empty keys (8 bytes each on the wire), its last ``missing`` bytes cut."""
    return encode_request(Request(Op.CHECK, (b"",) * keys))[:-missing]


def reconnecting_slow_check(
    port: int, seconds: float, connections: int = 100, source: str = "127.0.0.2"
) -> dict[str, int]:
    """Keep ``connections`` slow-CHECK attackers going for ``seconds``; return counts.

    The first attack of issue #14: a connection that never sends ``VALIDATE``
    sends a 1 MiB incomplete ``CHECK`` of 131,072 keys, then one byte every
    50 ms. A server with a secret closes it at the opcode byte, so every
    connection found closed (a send fails) is opened again at the next tick:
    ``connections`` are attempted throughout. Returns how many connections
    were opened, found closed, and failed to connect.
    """
    frame = slow_check_frame(MAX_MULTI_KEYS)
    slots: list[socket.socket | None] = [None] * connections
    counts = {"opened": 0, "closed": 0, "connect_failed": 0, "ticks": 0}
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            counts["ticks"] += 1
            for i, held in enumerate(slots):
                if time.monotonic() >= deadline:
                    break
                if held is None:
                    try:
                        sock = attacker(port, source)
                    except OSError:
                        counts["connect_failed"] += 1
                        continue
                    sock.settimeout(5)
                    counts["opened"] += 1
                    alive = send_quietly(sock, frame)
                else:
                    sock = held
                    alive = send_quietly(sock, b"\x00")
                if alive:
                    slots[i] = sock
                else:
                    sock.close()
                    slots[i] = None
                    counts["closed"] += 1
            time.sleep(0.05)
    finally:
        for left in slots:
            if left is not None:
                left.close()
    return counts


_ATTACK_CHILD = """
import json, sys
from tests.store.hostile import reconnecting_slow_check
print(json.dumps(reconnecting_slow_check(int(sys.argv[1]), float(sys.argv[2]))), flush=True)
"""


@contextmanager
def _child(code: str, *args: object) -> Iterator[subprocess.Popen[str]]:
    """Run ``code`` in a child process with ``args``; stop it (by pid) at the end.

    The child prints its counts as one JSON line when the attack is over.
    """
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *map(str, args)],
        stdout=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    try:
        yield proc
    finally:
        stop_process(proc, grace=15.0)
        if proc.stdout is not None:
            proc.stdout.close()


def attack_process(port: int, seconds: float) -> AbstractContextManager[subprocess.Popen[str]]:
    """Run :func:`reconnecting_slow_check` in a child process (:func:`_child`)."""
    return _child(_ATTACK_CHILD, port, seconds)


def waiting_attack(port: int, seconds: float, keys: int, hold: float = 0.5) -> dict[str, int]:
    """Eight ``WAIT`` s of ``keys`` keys, again and again, and writes to a waited key.

    The attack of issue #51 part 6: each round opens eight connections, each
    sending one ``WAIT`` of ``/hot`` and ``keys - 1`` absent keys (registering
    them costs the server one step per key), lets them block for ``hold``
    seconds while a ninth connection sets and deletes ``/hot`` (waking
    them costs a step per waiter), then closes them (removing them costs a
    step per key again). Returns how many rounds ran and how many ``WAIT`` s
    the server refused (their connection found closed).
    """
    names = [b"/hot", *(b"/absent-%07d" % i for i in range(keys - 1))]
    wait = VALIDATE + encode_request(Request(Op.WAIT, tuple(names)))
    pair = encode_request(Request(Op.SET, (b"/hot",), (b"1",))) + encode_request(
        Request(Op.DELETE_KEY, (b"/hot",))
    )
    counts = {"rounds": 0, "refused": 0}
    deadline = time.monotonic() + seconds
    with attacker(port) as writer:
        writer.sendall(VALIDATE)
        while time.monotonic() < deadline:
            counts["rounds"] += 1
            waiters = [attacker(port) for _ in range(8)]
            try:
                for sock in waiters:
                    send_quietly(sock, wait)
                until = time.monotonic() + hold
                while time.monotonic() < until:
                    writer.sendall(pair * 10)
                    got = 0
                    while got < 80:  # each DELETE_KEY answers an i64
                        chunk = writer.recv(80 - got)
                        assert chunk, "the server closed the writer"
                        got += len(chunk)
            finally:
                for sock in waiters:
                    sock.setblocking(False)
                    with suppress(OSError):
                        counts["refused"] += sock.recv(1) == b""
                    sock.close()
    return counts


_WAITING_CHILD = """
import json, sys
from tests.store.hostile import waiting_attack
print(json.dumps(waiting_attack(int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]))), flush=True)
"""


def waiting_attack_process(
    port: int, seconds: float, keys: int
) -> AbstractContextManager[subprocess.Popen[str]]:
    """Run :func:`waiting_attack` in a child process (:func:`_child`)."""
    return _child(_WAITING_CHILD, port, seconds, keys)
