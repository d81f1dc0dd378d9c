"""Shared pytest configuration and fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from rdzv.dynamic.handler import DynamicRendezvousHandler


@pytest.fixture
def handlers() -> Iterator[list[DynamicRendezvousHandler]]:
    """Handlers a test made (append them): stopped and their clients closed afterwards."""
    made: list[DynamicRendezvousHandler] = []
    try:
        yield made
    finally:
        for handler in made:
            handler.pre_shutdown()
        for handler in made:
            handler.close()
