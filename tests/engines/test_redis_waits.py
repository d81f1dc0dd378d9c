"""What a Redis wait costs: an empty slice reads nothing, a confirmation waits once.

At 8,192 members every read a waiter makes per slice is 8,192 reads: a
re-read after each empty 5 s ``XREAD`` slice, and three reads per 3.75 s
slice of the verdict's wait, were half of a formation's requests.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from rdzv.backends.base import Token
from rdzv.backends.redis import RedisRendezvousBackend
from rdzv.backends.redis import connection as redis_connection
from rdzv.dynamic.handler import DynamicRendezvousHandler
from rdzv.store.memory import HashStore
from rdzv.testing.clock import AutojumpClock

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]


def _calls(client: Any) -> dict[str, int]:
    """The server's command counts by name (scripts count as ``evalsha``)."""
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


def test_a_wait_of_many_slices_reads_the_state_once(
    redis_client: Any, unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(redis_connection, "MAX_BLOCK_SECONDS", 0.1)
    backend = RedisRendezvousBackend(redis_client, unique)
    written = backend.set_state(b"v1")
    assert written is not None
    assert backend.read_token() == written[1]  # loads the read script
    redis_client.config_resetstat()
    started = time.monotonic()
    assert backend.wait_for_token(written[1], 1.0) == written[1]
    assert time.monotonic() - started >= 0.95
    calls = _calls(redis_client)
    assert calls.get("evalsha") == 1, calls  # the read before the wait, none after a slice
    # Redis ends a block at its 100 ms timer: 0.1 s slices take up to 0.2 s.
    assert calls.get("xread", 0) >= 2, calls


class _Recorded(RedisRendezvousBackend):
    """Records its verdict waits; its node's confirmation comes ``hold`` seconds late."""

    def __init__(self, client: Any, run_id: str, waits: list[float], hold: float = 0.0) -> None:
        super().__init__(client, run_id)
        self.waits, self.hold = waits, hold  # shared with the confirmation view

    def enqueue(self, round_id: int, record: bytes) -> int:
        if self._queue_name == "confirm":
            time.sleep(self.hold)
        return super().enqueue(round_id, record)

    def wait_for_verdict(self, round_id: int, token: Token, timeout: float) -> bool | None:
        self.waits.append(timeout)
        return super().wait_for_verdict(round_id, token, timeout)


def test_a_member_waits_for_a_late_verdict_in_two_waits_not_in_slices(
    redis_client: Any, unique: str
) -> None:
    # Two members, dead after 3 s: the confirmation's slices are 0.75 s. The
    # second confirms 2.5 s late; the first waits one slice (then its ring
    # judges), and once more until the verdict, reading nothing in between.
    early: list[float] = []
    backends = [
        _Recorded(redis_client, unique, early),
        _Recorded(redis_client, unique, [], hold=2.5),
    ]
    store = HashStore(timeout=10)
    handlers = [
        DynamicRendezvousHandler.from_backend(
            "job", store, backend, 2, 2, local_addr=addr, keep_alive_interval=1.0
        )
        for addr, backend in zip(("a", "b"), backends, strict=True)
    ]
    try:
        with ThreadPoolExecutor(2) as pool:
            infos = [
                f.result(timeout=30) for f in [pool.submit(h.next_rendezvous) for h in handlers]
            ]
    finally:
        for handler in handlers:
            handler.shutdown()
    assert sorted(info.rank for info in infos) == [0, 1]
    assert len(early) == 2, early
    assert early[0] == pytest.approx(0.75)
    assert early[1] > 10  # the rest of the join timeout


def test_a_wait_ends_on_the_backends_clock(redis_client: Any, unique: str) -> None:
    # Each XREAD slice blocks for the time left; that it is over is the
    # clock's, which jumps to the wait's end (a real clock would not have moved).
    with AutojumpClock() as clock:
        backend = RedisRendezvousBackend(redis_client, unique, clock=clock)
        written = backend.set_state(b"one")
        assert written is not None
        begin = clock()
        assert backend.wait_for_verdict(1, written[1], 0.2) is None
        assert backend.wait_queue_length(1, 0, 0.2) == 0
        assert clock() - begin >= 0.4
