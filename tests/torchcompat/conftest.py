"""Side-by-side tests: the same call on torch 2.13's rendezvous and on rdzv's."""

from __future__ import annotations

import pytest

pytest.importorskip("torch.distributed.elastic.rendezvous")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.torch)
