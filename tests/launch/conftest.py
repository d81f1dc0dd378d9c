"""Fixtures of the launcher tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.store.helpers import serve_process


@pytest.fixture
def endpoint() -> Iterator[str]:
    """A store server (``rdzv serve``) on a free loopback port; yields its endpoint."""
    with serve_process() as (_proc, port):
        yield f"127.0.0.1:{port}"
