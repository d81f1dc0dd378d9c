"""Fixtures of the launcher tests."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.procs import subprocess_env


@pytest.fixture
def endpoint() -> Iterator[str]:
    """A store server (``rdzv serve``) on a free loopback port; yields its endpoint."""
    server = subprocess.Popen(
        [sys.executable, "-m", "rdzv.cli", "serve", "--host", "127.0.0.1", "--port", "0"],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        assert "listening on" in line, line
        yield line.split()[-1]
    finally:
        server.terminate()
        server.communicate(timeout=20)
