"""The store server under hostile clients, at full scale: rdzv next to torch.

Run from the repository root:

    python benchmarks/hostile_bench.py [--duration 10] [--attacks NAME ...] [--servers rdzv torch]

Each attack of issue #14 runs at the size the issue gives against a fresh
``rdzv serve`` (under a memory rlimit, ``--memory-limit-mib``) and against
torch's own ``TCPStore`` server (``is_master=True`` in its own process), one
after the other. The attacker runs in a child process; meanwhile this
process measures a well-behaved client's ``set`` + ``get`` round trips
(rdzv's client, authenticated when the rdzv server has a secret) for
``--duration`` seconds. The table shows the server's idle RSS, its peak RSS
growth during the attack (sampled every 50 ms), the CPU seconds it spent,
and the client's p50 / p99 latency and failed calls (a call that raised,
e.g. a connection refused or a 5 s timeout).

An rdzv server that has a secret is marked "auth"; torch's server has none,
so there the attacker is past the handshake. "fd1024" servers run with an
open-file limit of 1,024; "tls" with a TLS certificate (torch's server has
no TLS: the same connections are made to it in plain TCP).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import (
    VALIDATE,
    attacker,
    cpu_seconds,
    make_tls_files,
    quantile,
    rss_bytes,
    send_quietly,
    slow_check_frame,
    stamp,
    stop_process,
    subprocess_env,
    waiting_attack,
)
from rdzv.store.protocol import encode_bytes

MiB = 1 << 20
SECRET = "hostile-bench-secret"
ATTACKER_SOURCE = "127.0.0.2"
"""The attackers' source address; the measured client connects from 127.0.0.1."""


# -- attacks (run in the child process) ----------------------------------------


def _u64(n: int) -> bytes:
    return n.to_bytes(8, "little")


_connect = functools.partial(attacker, source=ATTACKER_SOURCE, timeout=10)


def _open_many(port: int, count: int, first: bytes) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        try:
            sock = _connect(port)
        except OSError:
            continue
        if first:
            send_quietly(sock, first)
        socks.append(sock)
    return socks


def attack_slow_check(port: int, duration: float, validate: bool) -> None:
    """96 connections, each a 1 MiB incomplete CHECK of 131,072 keys, then a byte every 50 ms."""
    socks = _open_many(port, 96, b"")
    for sock in socks:
        send_quietly(sock, (VALIDATE if validate else b"") + slow_check_frame(131072))
    deadline = time.monotonic() + duration
    while time.monotonic() < deadline:
        for sock in socks:
            send_quietly(sock, b"\x00")
        time.sleep(0.05)


def attack_big_value(port: int, duration: float) -> None:
    """200 connections, each an 8 MiB value one byte short (never authenticated)."""
    head = b"\x01" + encode_bytes(b"/big") + _u64(8 * MiB)
    body = b"x" * (8 * MiB - 1)
    socks = _open_many(port, 200, b"")
    for sock in socks:
        sock.settimeout(2)
        send_quietly(sock, VALIDATE + head + body)
    time.sleep(duration)


def attack_unread_gets(port: int, duration: float) -> None:
    """3.9 KB of GETs of a 1 MiB value that are never read, then a 24 KB MULTI_GET."""
    setter = _connect(port)
    setter.sendall(VALIDATE + b"\x01" + encode_bytes(b"/big") + encode_bytes(b"x" * MiB))
    setter.sendall(b"\x05" + _u64(1) + encode_bytes(b"/big"))  # CHECK: the SET is applied
    setter.recv(1)
    lazy = _connect(port, rcvbuf=4096)
    send_quietly(lazy, VALIDATE + (b"\x03" + encode_bytes(b"/big")) * 300)
    multi = _connect(port, rcvbuf=4096)
    send_quietly(multi, VALIDATE + b"\x0a" + _u64(2000) + encode_bytes(b"/big") * 2000)
    time.sleep(duration)


def attack_wait_keys(port: int, duration: float) -> None:
    """8 WAITs of 131,072 keys each, then SET/DELETE pairs on one of those keys."""
    keys = [b"/hot"] + [b"/absent-%07d" % i for i in range(131071)]
    wait = b"\x06" + _u64(len(keys)) + b"".join(encode_bytes(k) for k in keys)
    waiters = _open_many(port, 8, b"")
    for sock in waiters:
        send_quietly(sock, VALIDATE + wait)
    writer = _connect(port)
    writer.sendall(VALIDATE)
    pairs = (
        b"\x01" + encode_bytes(b"/hot") + encode_bytes(b"1") + b"\x08" + encode_bytes(b"/hot")
    ) * 100
    deadline = time.monotonic() + duration
    while time.monotonic() < deadline:
        if not send_quietly(writer, pairs):
            return
        for _ in range(100):  # DELETE_KEY answers an i64 each
            got = 0
            while got < 8:
                chunk = writer.recv(8 - got)
                if not chunk:
                    return
                got += len(chunk)


def attack_wait_rounds(port: int, duration: float) -> None:
    """Rounds of 8 WAITs of 65,536 keys held 0.5 s, SET/DELETE pairs on one key, then closed."""
    waiting_attack(port, duration, 65536)


def attack_append(port: int, duration: float) -> None:
    """3,000 APPENDs of 32 KiB to one key."""
    sock = _connect(port)
    sock.sendall(VALIDATE)
    frame = b"\x09" + encode_bytes(b"/grown") + encode_bytes(b"a" * 32768)
    for _ in range(3000):
        if not send_quietly(sock, frame):
            break
    time.sleep(duration)


def attack_idle(port: int, duration: float, count: int, validate: bool) -> None:
    """``count`` connections that send VALIDATE (or nothing) and then stay idle."""
    deadline = time.monotonic() + duration
    socks = _open_many(port, count, VALIDATE if validate else b"")
    while time.monotonic() < deadline:  # reconnect what the server closed, as an attacker would
        time.sleep(0.5)
        alive = []
        for sock in socks:
            try:
                sock.setblocking(False)
                closed = sock.recv(1) == b""
            except BlockingIOError:
                closed = False
            except OSError:
                closed = True
            if closed:
                sock.close()
            else:
                alive.append(sock)
        socks = alive + _open_many(port, count - len(alive), VALIDATE if validate else b"")


ATTACKS: dict[str, Callable[[int, float], None]] = {
    "slow-check": lambda port, d: attack_slow_check(port, d, validate=False),
    "slow-check-validated": lambda port, d: attack_slow_check(port, d, validate=True),
    "big-value": attack_big_value,
    "unread-gets": attack_unread_gets,
    "wait-keys": attack_wait_keys,
    "wait-rounds": attack_wait_rounds,
    "append": attack_append,
    "fd-limit": lambda port, d: attack_idle(port, d, 1100, validate=True),
    "idle-slots": lambda port, d: attack_idle(port, d, 200, validate=True),
    "tls-idle": lambda port, d: attack_idle(port, d, 1500, validate=False),
}


@dataclass
class Setup:
    """How the rdzv server is run for an attack."""

    auth: bool = False
    tls: bool = False
    nofile: int | None = None
    options: list[str] = field(default_factory=list)


SETUPS = {
    "slow-check": Setup(auth=True),
    "slow-check-validated": Setup(),
    "big-value": Setup(auth=True),
    "unread-gets": Setup(),
    "wait-keys": Setup(),
    "wait-rounds": Setup(),
    "append": Setup(),
    "fd-limit": Setup(nofile=1024),
    "idle-slots": Setup(auth=True, options=["--max-connections", "128"]),
    "tls-idle": Setup(tls=True),
}


# -- servers and measurement (the parent) ---------------------------------------


@dataclass
class Server:
    proc: subprocess.Popen[str]
    port: int

    def rss(self) -> int:
        """The server's resident memory in bytes; 0 once it died (a sample may race its death)."""
        try:
            return rss_bytes(self.proc.pid)
        except AssertionError:
            return 0

    def stop(self) -> None:
        stop_process(self.proc, grace=15.0)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _limits(memory_mib: int, nofile: int | None) -> Callable[[], None]:
    def apply() -> None:
        limit = memory_mib * MiB
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    return apply


def start_rdzv(setup: Setup, files: Path, memory_mib: int) -> Server:
    args = [sys.executable, "-m", "rdzv.cli", "serve", "--host", "127.0.0.1", "--port", "0"]
    if setup.auth:
        token = files / "token"
        token.write_text(SECRET)
        args += ["--auth-token-file", str(token)]
    if setup.tls:
        args += ["--tls-cert", str(files / "server.crt"), "--tls-key", str(files / "server.key")]
    args += setup.options
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=(files / "rdzv-serve.log").open("a"),
        text=True,
        env=subprocess_env(),
        preexec_fn=_limits(memory_mib, setup.nofile),  # noqa: PLW1509 - rlimits need it
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    return Server(proc, int(line.split()[4].rsplit(":", 1)[1]))


def start_torch(setup: Setup, files: Path) -> Server:
    code = (
        "import resource, sys, time, torch.distributed as dist\n"
        "s = dist.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
        "print(s.port, flush=True)\n"
        "time.sleep(1e6)\n"
    )
    nofile = setup.nofile

    def apply() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=(files / "torch-server.log").open("a"),
        text=True,
        env=subprocess_env(),
        preexec_fn=apply,  # noqa: PLW1509 - rlimits need it
    )
    assert proc.stdout is not None
    return Server(proc, int(proc.stdout.readline()))


def probe(port: int, duration: float, auth: bool, tls: Path | None) -> tuple[list[float], int, str]:
    """Time a well-behaved client's set + get for ``duration`` s.

    Returns:
        The sorted latencies, the number of failed calls, the first failure.
    """
    from rdzv.store.tcp import TCPStore

    taken: list[float] = []
    failures = 0
    first = ""
    options: dict[str, Any] = {"auth_token": SECRET if auth else None}
    if tls is not None:
        options["ssl_context"] = ssl.create_default_context(cafile=str(tls))
    deadline = time.monotonic() + duration
    store = None
    while time.monotonic() < deadline:
        started = time.perf_counter()
        try:
            if store is None:
                store = TCPStore("127.0.0.1", port, timeout=5, **options)
            store.set("probe", "x")
            store.get("probe")
            taken.append(time.perf_counter() - started)
        except Exception as exc:  # every failed call counts, whatever it raised
            failures += 1
            first = first or f"{type(exc).__name__}: {exc}"
            if store is not None:
                store.close()
            store = None
            time.sleep(0.1)
        time.sleep(0.01)
    if store is not None:
        store.close()
    return sorted(taken), failures, first


def run(attack: str, kind: str, files: Path, duration: float, memory_mib: int) -> dict[str, Any]:
    setup = SETUPS[attack]
    server = start_rdzv(setup, files, memory_mib) if kind == "rdzv" else start_torch(setup, files)
    try:
        time.sleep(0.5)
        idle = server.rss()
        cpu0 = cpu_seconds(server.proc.pid)
        peak = idle
        stop = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not stop.wait(0.05):
                if server.proc.poll() is not None:
                    return
                peak = max(peak, server.rss())

        sampler = threading.Thread(target=sample)
        sampler.start()
        child = subprocess.Popen(
            [sys.executable, __file__, "--attack-child", attack, str(server.port), str(duration)],
            env=subprocess_env(),
        )
        try:
            time.sleep(1.0)  # let the attack build up
            tls = files / "ca.crt" if setup.tls and kind == "rdzv" else None
            taken, failures, first = probe(
                server.port, duration, setup.auth and kind == "rdzv", tls
            )
        finally:
            child.wait(duration + 120)
            stop.set()
            sampler.join()
        alive = server.proc.poll() is None
        cpu = cpu_seconds(server.proc.pid) - cpu0 if alive else float("nan")
    finally:
        server.stop()
    label = kind
    for flag, on in (("auth", setup.auth), ("tls", setup.tls)):
        if on and kind == "rdzv":
            label += f" {flag}"
    if setup.nofile is not None:
        label += f" fd{setup.nofile}"
    return {
        "attack": attack,
        "server": label,
        "idle": idle,
        "peak": peak - idle,
        "cpu": cpu,
        "p50": quantile(taken, 0.5) if taken else None,
        "p99": quantile(taken, 0.99) if taken else None,
        "calls": len(taken),
        "failures": failures,
        "first_failure": first,
        "alive": alive,
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:,.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of each attack")
    parser.add_argument("--attacks", nargs="+", choices=list(ATTACKS), default=list(ATTACKS))
    parser.add_argument(
        "--servers", nargs="+", choices=["rdzv", "torch"], default=["rdzv", "torch"]
    )
    parser.add_argument("--memory-limit-mib", type=int, default=2048, help="rdzv's RLIMIT_AS")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    rows = []
    stamp("start")
    with tempfile.TemporaryDirectory() as tmp:
        files = Path(tmp)
        make_tls_files(files)
        for attack in args.attacks:
            for kind in args.servers:
                row = run(attack, kind, files, args.duration, args.memory_limit_mib)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    stamp("end")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(
        f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}, {args.duration:g} s per attack, "
        f"rdzv under RLIMIT_AS {args.memory_limit_mib} MiB\n"
    )
    print(
        "| attack | server | idle RSS MiB | RSS growth MiB | server CPU s "
        "| client p50 ms | p99 ms | calls ok / failed |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        died = "" if row["alive"] else " (server died)"
        print(
            f"| {row['attack']} | {row['server']}{died} | {row['idle'] / MiB:,.0f} "
            f"| {row['peak'] / MiB:,.1f} | {row['cpu']:.2f} | {_ms(row['p50'])} "
            f"| {_ms(row['p99'])} | {row['calls']} / {row['failures']} |"
        )


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--attack-child":
        ATTACKS[sys.argv[2]](int(sys.argv[3]), float(sys.argv[4]))
    else:
        main()
