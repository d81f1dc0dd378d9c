"""Helpers for tests that start subprocesses."""

from __future__ import annotations

import os
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


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
