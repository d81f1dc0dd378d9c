"""Fixtures of the store tests (the servers are in tests/conftest.py)."""

from __future__ import annotations

import uuid

import pytest


@pytest.fixture
def uid() -> str:
    """A prefix that keeps this test's keys apart from other tests' on shared servers."""
    return uuid.uuid4().hex[:12]
