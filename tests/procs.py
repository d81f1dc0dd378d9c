"""Helpers for tests that start subprocesses."""

from __future__ import annotations

import os
import random
import shutil
import socket
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
ROOT = SRC.parent


def subprocess_env(**extra: str) -> dict[str, str]:
    """Return an environment in which a child ``python`` imports this tree's rdzv."""
    env = dict(os.environ)
    parts = [str(SRC), str(ROOT)]
    if env.get("PYTHONPATH"):
        parts.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env.update(extra)
    return env


def require_binary(name: str) -> str:
    """Return the path of ``name`` or fail loudly (never skip)."""
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(
            f"the {name!r} binary is not on PATH; run `bash scripts/setup` "
            "(it installs etcd-server, redis-server and openssl)"
        )
    return path


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (32768 when unknown)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_FREE_PORT_FLOOR = 15000
_ports = random.Random()


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago.

    The port is below the kernel's ephemeral range when there is room: a port
    from that range can be taken, between this check and the test's own
    bind, as the local port of any outgoing connection on the machine (a
    second suite beside this one, a busy CI host), and the test then meets a
    stranger or nobody on it. A port below the range is only ever taken by
    an explicit bind.
    """
    low = _ephemeral_low()
    for _ in range(200 if low - _FREE_PORT_FLOOR >= 1000 else 0):
        port = _ports.randrange(_FREE_PORT_FLOOR, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
