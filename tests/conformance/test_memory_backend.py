from collections.abc import Iterator

import pytest

from rdzv.backends.base import RendezvousBackend
from rdzv.testing import InMemoryBackend, InMemoryRendezvousStorage
from rdzv.testing.conformance import CHECKS, BackendHarness, Check, run_conformance


class MemoryHarness(BackendHarness):
    def __init__(self) -> None:
        self.storage = InMemoryRendezvousStorage()

    def connect(self) -> RendezvousBackend:
        return InMemoryBackend(self.storage)

    def connect_other_run(self) -> RendezvousBackend:
        return InMemoryBackend(InMemoryRendezvousStorage())

    def corrupt_state(self) -> None:
        self.storage.corrupt_state()


@pytest.fixture
def harness() -> Iterator[MemoryHarness]:
    h = MemoryHarness()
    try:
        yield h
    finally:
        h.close()


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.name)
def test_memory_backend_conformance(check: Check, harness: MemoryHarness) -> None:
    check.run(harness)


def test_run_conformance_runs_every_check() -> None:
    assert run_conformance(MemoryHarness) == [c.name for c in CHECKS]


class _BrokenBackend(InMemoryBackend):
    def set_state(self, state: bytes, token: object = None) -> tuple[bytes, object, bool] | None:
        result = super().get_state()
        # Ignores the token: a lost-update bug the suite must catch.
        if result is None:
            return super().set_state(state, None)
        return super().set_state(state, result[1])


class BrokenHarness(MemoryHarness):
    def connect(self) -> RendezvousBackend:
        return _BrokenBackend(self.storage)


def test_suite_catches_a_backend_that_ignores_tokens() -> None:
    with pytest.raises(AssertionError):
        run_conformance(BrokenHarness)


def test_fail_next_injects_connection_errors() -> None:
    from rdzv.errors import RendezvousConnectionError

    storage = InMemoryRendezvousStorage()
    backend = InMemoryBackend(storage)
    storage.fail_next(2)
    for _ in range(2):
        with pytest.raises(RendezvousConnectionError):
            backend.get_state()
    assert backend.get_state() is None
