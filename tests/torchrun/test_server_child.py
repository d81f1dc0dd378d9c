"""``python -m rdzv.torchrun serve PORT``: the ``rdzv`` backend's store server child."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from rdzv.store.tcp import TCPStore
from tests.procs import subprocess_env

pytestmark = pytest.mark.timeout(60)

COMMAND = [sys.executable, "-m", "rdzv.torchrun"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*COMMAND, *args],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


@pytest.mark.parametrize("args", [(), ("serve",), ("run", "29400")])
def test_without_serve_port_it_prints_the_usage(args: tuple[str, ...]) -> None:
    done = run(*args)
    assert done.returncode == 1
    assert done.stderr.strip() == "usage: python -m rdzv.torchrun serve PORT [options]"


def test_a_taken_port_is_an_error_line() -> None:
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        done = run("serve", str(taken.getsockname()[1]))
    assert done.returncode == 1
    assert done.stdout.startswith("error "), done.stdout


def test_it_serves_until_stdin_closes_and_its_last_client_left() -> None:
    with subprocess.Popen(
        [*COMMAND, "serve", "0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=subprocess_env(),
        text=True,
    ) as child:
        assert child.stdin is not None
        assert child.stdout is not None
        try:
            line = child.stdout.readline()
            assert line.startswith("listening "), line
            client = TCPStore("127.0.0.1", int(line.split()[1]), timeout=5)
            client.set("k", b"v")
            child.stdin.close()
            time.sleep(0.5)
            assert child.poll() is None, "the child must wait for its last client"
            assert client.get("k") == b"v"
            client.close()
            assert child.wait(timeout=10) == 0
        finally:
            if child.poll() is None:
                child.kill()
