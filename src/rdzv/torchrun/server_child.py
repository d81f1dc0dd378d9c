"""The ``rdzv`` backend's store server, run in a child process of the hosting agent.

torch's ``TCPStore`` client keeps the GIL during some calls, so it must not
talk to a server in its own process: the node that hosts the endpoint runs
the rdzv server in a child process (``python -m rdzv.torchrun serve PORT``).
The child exits when its stdin closes (the agent shut down or died) and its
last client disconnected, or a few seconds later at most. With a shared
secret or TLS (``auth_token_file``/``$RDZV_AUTH_TOKEN``, ``ssl_cert``/
``ssl_cert_key``) the child gets them too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import rdzv

__all__ = ["main"]

_SERVER_START_TIMEOUT = 30.0
_SERVER_LINGER = 5.0


class _ServerStartError(Exception):
    """The server child could not serve; the message says why."""


class _ServerProcess:
    """An rdzv TCP store server running in a child process."""

    def __init__(self, proc: subprocess.Popen[str], port: int) -> None:
        self._proc = proc
        self.port = port

    @classmethod
    def start(
        cls,
        port: int,
        auth_token_file: str | None,
        tls_files: tuple[str, str] | None,
        listen: Sequence[str] | None = None,
    ) -> _ServerProcess:
        """Start a server on ``port``, on the addresses of ``listen`` (None: every address).

        Args:
            port: The port to serve on.
            listen: The addresses to listen on (see :func:`~rdzv.net.listen_addresses`).
            auth_token_file: The file holding the store's secret, or None (the
                secret may also come from ``$RDZV_AUTH_TOKEN``, which the
                child inherits).
            tls_files: The certificate and key to serve TLS with, or None.

        Returns:
            The running server.

        Raises:
            _ServerStartError: The child could not serve (the port is taken,
                or a file could not be read); the message is the child's.
        """
        options: tuple[str, ...] = (
            () if auth_token_file is None else ("--auth-token-file", auth_token_file)
        )
        if tls_files is not None:
            options += ("--tls-cert", tls_files[0], "--tls-key", tls_files[1])
        for address in listen or ():
            options += ("--listen", address)
        env = dict(os.environ)
        package_root = str(Path(rdzv.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        proc = subprocess.Popen(
            [sys.executable, "-m", "rdzv.torchrun", "serve", str(port), *options],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        assert proc.stdout is not None
        line = _read_line(proc.stdout, _SERVER_START_TIMEOUT)
        if line.startswith("listening "):
            return cls(proc, int(line.split()[1]))
        cls(proc, port).stop()
        raise _ServerStartError(line.strip().removeprefix("error "))

    def stop(self) -> None:
        """Tell the child to exit once its clients are gone, and reap it."""
        proc = self._proc
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        try:
            proc.wait(timeout=_SERVER_LINGER + 5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _read_line(stream: IO[str], timeout: float) -> str:
    with selectors.DefaultSelector() as selector:
        selector.register(stream, selectors.EVENT_READ)
        if not selector.select(timeout):
            return f"no answer within {timeout:g} s"
    return stream.readline() or "exited"


def main(argv: list[str]) -> int:
    """Run the child: serve until stdin closes, then until the clients left (bounded).

    It prints ``listening PORT`` once it serves, or ``error MESSAGE`` if it
    cannot.

    Args:
        argv: The command line after the program: ``serve PORT
            [--auth-token-file F] [--tls-cert C --tls-key K] [--listen ADDR ...]``
            (no ``--listen``: every address).

    Returns:
        The exit status: 0 after serving, 1 if the usage is wrong or the
        server could not start.
    """
    if len(argv) < 2 or argv[0] != "serve":
        print("usage: python -m rdzv.torchrun serve PORT [options]", file=sys.stderr)
        return 1
    import argparse  # noqa: PLC0415 - only in the child

    from rdzv.store.serve import ServerSecurity, secured_server  # noqa: PLC0415 - child only

    parser = argparse.ArgumentParser(prog="python -m rdzv.torchrun serve")
    parser.add_argument("port", type=int)
    parser.add_argument("--auth-token-file", default=None)
    parser.add_argument("--tls-cert", default=None)
    parser.add_argument("--tls-key", default=None)
    parser.add_argument("--listen", action="append", default=None)
    args = parser.parse_args(argv[1:])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the agent decides when we stop
    # The child is a program of its own: its warnings (misbehaving clients)
    # go to stderr, which it shares with the agent.
    logging.basicConfig(level=logging.WARNING, format="rdzv store server: %(message)s")
    try:
        security = ServerSecurity.from_files(args.auth_token_file, args.tls_cert, args.tls_key)
        server = secured_server(args.listen, args.port, security).start()
    except (OSError, ValueError, ssl.SSLError) as exc:
        print(f"error {exc}", flush=True)
        return 1
    print(f"listening {server.port}", flush=True)
    sys.stdin.read()
    deadline = time.monotonic() + _SERVER_LINGER
    while server.connection_count() > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    server.stop()
    return 0
