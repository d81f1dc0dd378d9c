"""rdzv serve's admission options reach the server, and bad values are one-line errors;
a client meeting a program that is not a store says so at once."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

import pytest

from rdzv.errors import RendezvousConnectionError
from rdzv.store.tcp import TCPStore
from tests.procs import subprocess_env
from tests.store.helpers import serve_process


@pytest.mark.parametrize(
    ("option", "named"),
    [
        ("--max-handshakes=0", "max_handshakes must be at least 1, got 0"),
        ("--handshake-timeout=nan", "handshake_timeout must be a positive number"),
        ("--max-connections-per-address=0", "max_connections_per_address must be at least 1"),
    ],
)
def test_a_bad_admission_option_is_one_line_naming_it(option: str, named: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "rdzv.cli", "serve", "--port", "0", option],
        check=False,
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=60,
    )
    assert done.returncode == 1, done
    assert done.stderr.count("\n") == 1, done.stderr
    assert named in done.stderr
    assert "Traceback" not in done.stderr


def test_handshake_timeout_closes_a_connection_that_never_handshakes() -> None:
    # The frame timeout is an hour: only --handshake-timeout can close the peer.
    with serve_process("--handshake-timeout=0.5", "--frame-timeout=3600") as (_proc, port):
        sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        with sock:
            assert sock.recv(1) == b""  # closed by the server, nothing sent


@pytest.mark.slow
def test_a_port_held_by_a_silent_program_fails_at_the_handshake_timeout_not_the_store_timeout() -> (
    None
):
    with socket.socket() as other:  # accepts connections (the backlog), never answers
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(RendezvousConnectionError, match="sent no reply to the store handshake"):
            # A 600 s store timeout: only the handshake timeout can end this early.
            TCPStore("127.0.0.1", port, timeout=600)


def test_a_port_held_by_a_program_answering_garbage_fails_at_once() -> None:
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]

        def answer() -> None:
            conn, _ = other.accept()
            with conn:
                conn.settimeout(30)
                conn.recv(1)  # the handshake came; answer it as a web server would
                conn.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n")
                while conn.recv(4096):  # until the client hangs up: no RST eats the answer
                    pass

        thread = threading.Thread(target=answer, daemon=True)
        thread.start()
        with pytest.raises(RendezvousConnectionError, match="which no TCP store sends"):
            TCPStore("127.0.0.1", port, timeout=600)
        thread.join(30)
