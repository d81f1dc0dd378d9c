"""An authenticated c10d rendezvous under the first attack of issue #14.

Three nodes (real handlers, in threads of this process, one of them hosting
the store with a secret) form a round with the default keep-alive (a beat
every 5 s, dead after 3 missed). A child process then keeps 100
unauthenticated connections going against the store's port for
``RDZV_ATTACK_SECONDS`` (default 15) seconds: each sends a 1 MiB incomplete
``CHECK`` of 131,072 keys and one byte every 50 ms, and is opened again
whenever the server closes it (it does, at the opcode byte). Meanwhile the
nodes' keep-alives run as in a job, each node asks ``num_nodes_waiting()``
once a second as an agent's monitor loop does, and an authenticated client
times ``set`` + ``get``.

The issue's criterion: nobody is evicted and the round does not re-form.
The figures (client p50 / p99, the attacker's connections, the growth of
this process's RSS, which hosts the store server) are printed; run with
``-s`` and ``RDZV_ATTACK_SECONDS=60`` for the issue's 60 s.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import rdzv
from rdzv.api import (
    DEFAULT_KEEP_ALIVE_INTERVAL,
    DEFAULT_KEEP_ALIVE_MAX_ATTEMPT,
    RendezvousParameters,
)
from rdzv.dynamic.handler import DynamicRendezvousHandler
from rdzv.dynamic.state import RendezvousState, decode_state
from tests.procs import free_port, rss_bytes
from tests.store.hostile import attack_process, latencies, quantile

ATTACK_SECONDS = float(os.environ.get("RDZV_ATTACK_SECONDS", "15"))
"""How long the attack runs; the issue asks for 60 s, CI runs 15."""

pytestmark = [pytest.mark.slow, pytest.mark.timeout(ATTACK_SECONDS + 180)]

SECRET = "attacked-rendezvous-secret"
NODES = 3
MiB = 1 << 20
RSS_BOUND = 64 * MiB
"""The issue's bound on the store server's memory growth under an attack."""
P50_BOUND = 0.5
P99_BOUND = 1.0
"""Seconds: generous bounds on the authenticated client's median and p99
set+get: a millisecond on a quiet machine, a p99 of 0.16 s with the load
average at 15. They catch a server that stalls behind the attackers (with the
pre-authentication opcode check taken out, the server parsed their requests
and the p99 was 2.5 s), not a slow machine."""
# Events that mean the round changed: a judgement, an eviction, a new join.
REFORMING = {"dead", "evict", "join", "enqueue", "requeue", "sealed", "complete", "fail", "broken"}


class Events(logging.Handler):
    """Collects the handlers' structured events (the ``rdzv.dynamic`` logger)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.events: list[dict[str, Any]] = []
        self._lock_events = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        event = getattr(record, "rdzv_event", None)
        if event is not None:
            with self._lock_events:
                self.events.append(dict(event))

    def since(self, start: int) -> list[dict[str, Any]]:
        with self._lock_events:
            return list(self.events[start:])


@pytest.fixture
def events() -> Iterator[Events]:
    logger = logging.getLogger("rdzv.dynamic")
    collector = Events()
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(collector)
    try:
        yield collector
    finally:
        logger.removeHandler(collector)
        logger.setLevel(level)


def _state(handler: DynamicRendezvousHandler) -> RendezvousState:
    stored = handler.backend.get_state()
    assert stored is not None
    return decode_state(stored[0])


def _params(port: int, token: Path, host: bool) -> RendezvousParameters:
    # Default keep-alive and timeouts: only what a c10d node must name.
    return RendezvousParameters(
        "c10d",
        f"127.0.0.1:{port}",
        "attacked",
        NODES,
        NODES,
        local_addr="127.0.0.1",
        is_host=host,
        auth_token_file=str(token),
    )


def test_an_authenticated_rendezvous_under_a_connection_flood_evicts_nobody(
    tmp_path: Path, handlers: list[DynamicRendezvousHandler], events: Events
) -> None:
    token = tmp_path / "token"
    token.write_text(SECRET)
    port = free_port()
    for host in (True,) + (False,) * (NODES - 1):  # the host first: it starts the server
        handler = rdzv.create_handler(_params(port, token, host))
        assert isinstance(handler, DynamicRendezvousHandler)
        handlers.append(handler)
    settings = handlers[0].settings
    assert settings.keep_alive_interval.total_seconds() == DEFAULT_KEEP_ALIVE_INTERVAL
    assert settings.keep_alive_max_attempt == DEFAULT_KEEP_ALIVE_MAX_ATTEMPT

    with ThreadPoolExecutor(NODES) as pool:
        infos = list(pool.map(lambda h: h.next_rendezvous(), handlers))
    assert sorted(info.rank for info in infos) == list(range(NODES))
    formed = _state(handlers[0])
    assert len(formed.live_participants()) == NODES
    for handler, info in zip(handlers, infos, strict=True):
        assert formed.rank_of(handler.node) == info.rank
    after_forming = len(events.since(0))

    waiting: list[int] = []
    probe: dict[str, Any] = {}

    def measure() -> None:
        try:
            probe["taken"] = latencies(port, ATTACK_SECONDS - 1.0, auth_token=SECRET)
        except BaseException as exc:  # reported by the main thread
            probe["error"] = exc

    idle_rss = peak_rss = rss_bytes()
    started = time.monotonic()
    with attack_process(port, ATTACK_SECONDS) as attack:
        time.sleep(1.0)  # let the attack build up
        prober = threading.Thread(target=measure)
        prober.start()
        ticks = 0
        while attack.poll() is None and time.monotonic() - started < ATTACK_SECONDS + 60:
            time.sleep(0.25)
            peak_rss = max(peak_rss, rss_bytes())
            ticks += 1
            if ticks % 4 == 0:  # an agent's monitor loop asks once a second
                waiting.extend(handler.num_nodes_waiting() for handler in handlers)
        prober.join(60)
        assert attack.stdout is not None
        assert attack.wait(60) == 0
        counts = json.loads(attack.stdout.readline())
    attacked_for = time.monotonic() - started

    # The attack ran as the first row with a secret: the server
    # closed the attackers' connections and they were opened again.
    assert counts["opened"] >= 100, counts
    assert counts["closed"] >= 100, counts
    assert "error" not in probe, probe
    taken = probe["taken"]
    p50, p99 = quantile(taken, 0.5), quantile(taken, 0.99)
    later = events.since(after_forming)
    figures = {
        "attack_seconds": round(attacked_for, 1),
        "attacker": counts,
        "client_calls": len(taken),
        "client_p50_ms": round(p50 * 1000, 1),
        "client_p99_ms": round(p99 * 1000, 1),
        "client_max_ms": round(taken[-1] * 1000, 1),
        "rss_growth_mib": round((peak_rss - idle_rss) / MiB, 1),
        "num_nodes_waiting_nonzero": sum(1 for n in waiting if n),
        "events_after_forming": sorted({e["action"] for e in later}),
        "keepalive_failed": sum(1 for e in later if e["action"] == "keepalive-failed"),
    }
    print("attacked rendezvous:", json.dumps(figures))

    # Nobody was evicted and the round did not re-form: same round, same
    # members, each node still a participant at its rank, nobody waiting.
    after = _state(handlers[0])
    assert after.round == formed.round
    assert after.participants == formed.participants
    assert after.evicted == frozenset()
    for handler, info in zip(handlers, infos, strict=True):
        assert after.rank_of(handler.node) == info.rank
        assert handler.num_nodes_waiting() == 0
    assert waiting
    assert not any(waiting), waiting
    assert not [e for e in later if e["action"] in REFORMING], later
    # The authenticated client was served all along, and the store server
    # (in this process) stayed within the memory bound.
    assert p50 < P50_BOUND, figures
    assert p99 < P99_BOUND, figures
    assert peak_rss - idle_rss < RSS_BOUND, figures
