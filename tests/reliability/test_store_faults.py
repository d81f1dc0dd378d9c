"""The handler against a store or backend that stops answering: real processes, real time.

These faults are about wall-clock bounds (a paused ``rdzv serve``, a
SIGKILLed store host, a backend whose calls block), so they run on real
time with generous bounds; the decisions they exercise are tested on a fake
clock in ``tests/dynamic``.
"""

import os
import signal
import threading
import time

import pytest

from rdzv.api import RendezvousTimeout
from rdzv.backends.base import Token
from rdzv.backends.store import C10dRendezvousBackend
from rdzv.dynamic.handler import DynamicRendezvousHandler
from rdzv.dynamic.state import decode_state
from rdzv.errors import RendezvousConnectionError, RendezvousTimeoutError
from rdzv.store.memory import HashStore
from rdzv.store.tcp import TCPStore
from rdzv.testing import InMemoryBackend, InMemoryRendezvousStorage
from tests.store.helpers import serve_process

pytestmark = pytest.mark.timeout(30)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_paused_store_evicts_nobody() -> None:
    """SIGSTOP the store host for longer than the dead-node bound while all members live."""
    with serve_process() as (proc, port):
        # Calls time out during the pause: the observers' reads fail, and the
        # first ones after it may see marks from before it.
        store = TCPStore("127.0.0.1", port, timeout=1.5)
        clients = [store.clone() for _ in range(3)]
        backends = [C10dRendezvousBackend(c, "job", c.clone()) for c in clients]
        handlers = [
            DynamicRendezvousHandler.from_backend(
                "job",
                clients[i],
                backend,
                3,
                3,
                f"n{i}",
                timeout=RendezvousTimeout(join=60, last_call=0.1),
                keep_alive_interval=0.5,
                keep_alive_max_attempt=3,
            )
            for i, backend in enumerate(backends)
        ]
        threads = [threading.Thread(target=h.next_rendezvous) for h in handlers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert all(h.statistics().round is not None for h in handlers)
        time.sleep(1.0)  # everyone beats and judges for a while
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            time.sleep(5.0)  # > 3 x 0.5 s: every mark looks frozen on the observers' clocks
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        time.sleep(3.0)  # the observers judge again after the pause
        found = backends[0].get_state()
        assert found is not None
        state = decode_state(found[0])
        assert state.evicted == frozenset(), f"live members were evicted: {state.evicted}"
        assert all(h.num_nodes_waiting() == 0 for h in handlers)
        for h in handlers:
            h.close()
        store.close()


class HangingBackend(InMemoryBackend):
    """Once ``hang`` is set, every state call blocks (a store host that stopped answering)."""

    def __init__(self, storage: InMemoryRendezvousStorage) -> None:
        super().__init__(storage)
        self.hang = threading.Event()
        self.release = threading.Event()

    def get_state(self) -> tuple[bytes, Token] | None:
        if self.hang.is_set():
            self.release.wait(60)
        return super().get_state()


@pytest.mark.slow
def test_shutdown_and_set_closed_on_a_backend_that_stopped_answering_return_in_time() -> None:
    backend = HangingBackend(InMemoryRendezvousStorage())
    handler = DynamicRendezvousHandler.from_backend(
        "job",
        HashStore(timeout=5),
        backend,
        1,
        1,
        "n1",
        timeout=RendezvousTimeout(join=10, last_call=0.1, close=1.0),
        keep_alive_interval=0.2,
    )
    handler.next_rendezvous()
    backend.hang.set()
    try:
        started = time.monotonic()
        with pytest.raises(RendezvousTimeoutError, match="did not finish within 1 s"):
            handler.set_closed()
        assert handler.shutdown() is False
        # generous bounds that catch the old behaviour (blocked until released)
        assert time.monotonic() - started < 30
    finally:
        backend.release.set()
        handler.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_calls_after_the_store_host_died_fail_within_the_reconnect_timeout() -> None:
    with serve_process() as (proc, port):
        store = TCPStore("127.0.0.1", port, timeout=60)
        store.set("k", "v")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        times = []
        for _ in range(3):
            started = time.monotonic()
            with pytest.raises(RendezvousConnectionError):
                store.get("k")
            times.append(time.monotonic() - started)
        store.close()
    # Each call gives up after the reconnect timeout (3 s), not the 60 s store
    # timeout; the bound is generous for a loaded machine.
    assert max(times) < 3.0 + 10.0, times
