"""Faults the handler must bound and name: bad settings, forged records, contract breakers,
and a keep-alive that survives errors in its judging."""

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from rdzv.api import RendezvousParameters, RendezvousSettings, RendezvousTimeout
from rdzv.backends.base import MAX_RUN_ID, RendezvousBackend, Token
from rdzv.backends.kv import StoreLiveness
from rdzv.backends.options import StoreBackendOptions
from rdzv.backends.store import C10dRendezvousBackend
from rdzv.dynamic.handler import DynamicRendezvousHandler
from rdzv.dynamic.state import RendezvousState, decode_state, encode_state
from rdzv.errors import (
    RendezvousConnectionError,
    RendezvousExhaustedError,
    RendezvousStateError,
)
from rdzv.retry import Clock
from rdzv.store.memory import HashStore
from rdzv.testing import AutojumpClock, InMemoryBackend, InMemoryRendezvousStorage
from tests.procs import CountingStore, wait_until

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("value", [math.inf, 1e308, 400 * 24 * 3600])
def test_an_absurd_duration_is_a_value_error_naming_it(value: float) -> None:
    with pytest.raises(ValueError, match="join timeout must be finite and at most"):
        RendezvousTimeout(join=value)
    params = RendezvousParameters("c10d", "h:1", "job", 1, 1, join_timeout=str(value))
    with pytest.raises(ValueError, match="'join_timeout' must be finite"):
        RendezvousSettings.from_params(params)


def test_nan_is_not_a_duration() -> None:
    with pytest.raises(ValueError, match=r"The last_call timeout \(nan\) must be positive"):
        RendezvousTimeout(last_call=math.nan)
    params = RendezvousParameters("c10d", "h:1", "job", 1, 1, keep_alive_interval="nan")
    with pytest.raises(ValueError, match="'keep_alive_interval' must be finite"):
        RendezvousSettings.from_params(params)


def test_a_run_id_too_long_for_keys_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=f"100000 characters long; the limit is {MAX_RUN_ID}"):
        RendezvousSettings("x" * 100_000, 1, 1)
    RendezvousSettings("x" * MAX_RUN_ID, 1, 1)


def test_a_run_id_with_a_terminal_escape_is_refused_and_shown_escaped() -> None:
    with pytest.raises(ValueError, match="control characters") as info:
        RendezvousSettings("job\x1b[2J", 1, 1)
    assert "\x1b" not in str(info.value)
    assert "\\x1b" in str(info.value)


def test_a_forged_maximal_generation_is_a_state_error() -> None:
    store = HashStore()
    backend = C10dRendezvousBackend(store, "job")
    result = backend.set_state(b"s1")
    assert result is not None
    token = result[1]
    forged = token[:4] + (2**64 - 1).to_bytes(8, "big") + token[12:]
    store.set("rdzv.backend/job/state", forged)
    store.set(f"rdzv.backend/job/state/{forged[4:].hex()}", b"s1")
    found = backend.get_state()
    assert found is not None
    with pytest.raises(RendezvousStateError, match="generation 2\\*\\*64-1"):
        backend.set_state(b"s2", found[1])


class SilentWriter(RendezvousBackend):
    """torch's contract allows ``set_state`` to return None: this one writes, then says None."""

    def __init__(self, inner: InMemoryBackend, write: bool = True) -> None:
        self.inner, self.write = inner, write

    @property
    def name(self) -> str:
        return "silent"

    def get_state(self) -> tuple[bytes, Token] | None:
        return self.inner.get_state()

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        if self.write:
            self.inner.set_state(state, token)
        return None


def _handler(backend: RendezvousBackend, join: float = 20) -> DynamicRendezvousHandler:
    return DynamicRendezvousHandler.from_backend(
        "job",
        HashStore(timeout=5),
        backend,
        1,
        1,
        local_addr="n1",
        timeout=RendezvousTimeout(join=join, last_call=0.1),
        keep_alive_interval=0.2,
    )


def test_a_backend_whose_set_state_returns_none_after_writing_works() -> None:
    handler = _handler(SilentWriter(InMemoryBackend(InMemoryRendezvousStorage())))
    info = handler.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    handler.close()


def test_a_backend_that_breaks_the_contract_is_named_at_once_not_after_the_join_timeout() -> None:
    handler = _handler(SilentWriter(InMemoryBackend(InMemoryRendezvousStorage()), write=False))
    started = time.monotonic()
    with pytest.raises(RendezvousStateError, match=r"'silent' backend .* broke the backend"):
        handler.next_rendezvous()
    assert time.monotonic() - started < 10  # generous: the join timeout is 20 s
    handler.close()


class FlakyMarks(InMemoryBackend):
    """Reading another node's heartbeat mark fails with anything, for a while."""

    def __init__(
        self, storage: InMemoryRendezvousStorage, fail: Callable[[], bool], clock: Clock
    ) -> None:
        super().__init__(storage, clock)
        self.fail = fail

    def heartbeat_mark(self, node: str) -> bytes | None:
        if self.fail():
            raise RuntimeError("a bug in a third-party backend")
        return super().heartbeat_mark(node)


def test_an_error_while_judging_never_stops_the_heartbeat() -> None:
    storage = InMemoryRendezvousStorage()
    failing = threading.Event()
    failing.set()
    settings: dict[str, Any] = {
        "timeout": RendezvousTimeout(last_call=0.1),
        "keep_alive_interval": 0.1,
    }
    store = HashStore(timeout=5)
    clock = AutojumpClock()
    observer = DynamicRendezvousHandler.from_backend(
        "job", store, FlakyMarks(storage, failing.is_set, clock), 2, 2, "a", **settings, clock=clock
    )
    other = DynamicRendezvousHandler.from_backend(
        "job", store, InMemoryBackend(storage, clock), 2, 2, "b", **settings, clock=clock
    )
    threads = [threading.Thread(target=h.next_rendezvous) for h in (observer, other)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        beats = InMemoryBackend(storage).heartbeat_mark(observer.node)
        start = clock()
        wait_until(lambda: clock() >= start + 1.0)  # 10 judging ticks that all raise
        assert observer.statistics().keepalive_running
        assert InMemoryBackend(storage).heartbeat_mark(observer.node) != beats
        failing.clear()
        other.pre_shutdown()  # the observer's successor stops beating: judged and evicted
        wait_until(lambda: observer.num_nodes_waiting() > 0)
    finally:
        observer.close()
        other.close()
        clock.close()


class BrokenMarks(InMemoryBackend):
    """Reading several marks at once always fails with anything (a third-party bug)."""

    def heartbeat_marks(self, nodes: Sequence[str]) -> dict[str, bytes | None]:
        raise RuntimeError("a bug in a third-party backend's batch read")


def test_a_seal_whose_read_of_the_marks_fails_goes_on_without_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    storage = InMemoryRendezvousStorage()
    store = HashStore(timeout=5)
    handlers = [
        DynamicRendezvousHandler.from_backend(
            "job", store, BrokenMarks(storage), 2, 2, addr, keep_alive_interval=5.0
        )
        for addr in ("a", "b")
    ]
    try:
        with caplog.at_level(logging.INFO, logger="rdzv.dynamic"), ThreadPoolExecutor(2) as pool:
            infos = [
                f.result(timeout=30) for f in [pool.submit(h.next_rendezvous) for h in handlers]
            ]
        assert sorted(i.rank for i in infos) == [0, 1]
        events = [getattr(r, "rdzv_event", {}) for r in caplog.records]
        failed = [e for e in events if e.get("action") == "marks-failed"]
        assert len(failed) == 1, failed  # the one seal
        assert "RuntimeError: a bug in a third-party backend's batch read" in failed[0]["error"]
        # Without sealed marks the members' seats carry none, as before.
        watched = [h.statistics().watched for h in handlers]
        assert all(w is not None and w.sealed_mark is None for w in watched), watched
    finally:
        for h in handlers:
            h.close()


def test_a_failed_join_stops_the_heartbeat() -> None:
    storage = InMemoryRendezvousStorage()
    handler = DynamicRendezvousHandler.from_backend(
        "job",
        HashStore(timeout=5),
        InMemoryBackend(storage),
        2,
        2,
        "lonely",
        timeout=RendezvousTimeout(join=0.5, last_call=0.1),
        keep_alive_interval=0.1,
    )
    with pytest.raises(RendezvousExhaustedError, match="without reaching min nodes"):
        handler.next_rendezvous()
    assert not handler.statistics().keepalive_running
    mark = InMemoryBackend(storage).heartbeat_mark(handler.node)
    time.sleep(0.5)
    assert InMemoryBackend(storage).heartbeat_mark(handler.node) == mark
    handler.close()


def test_marks_of_many_members_are_read_in_one_call() -> None:
    calls: list[str] = []
    store: Any = CountingStore(HashStore(timeout=5), lambda name, args, result: calls.append(name))
    liveness = StoreLiveness(store, "p/")
    nodes = [f"n{i}" for i in range(1000)]
    for node in nodes[:10]:
        liveness.beat(node)
    marks = liveness.heartbeat_marks(nodes)
    assert calls.count("try_multi_get") == 1
    assert [marks[n] for n in nodes[:10]] == [b"1"] * 10
    assert all(marks[n] is None for n in nodes[10:])


def test_a_poisoned_heartbeat_counts_as_no_beat_and_its_owner_repairs_it() -> None:
    store = HashStore(timeout=5)
    liveness = StoreLiveness(store, "p/")
    liveness.beat("victim")
    store.set("p/hb/victim", b"not-a-number")
    assert liveness.heartbeat_marks(["victim"]) == {"victim": b"not-a-number"}
    liveness.beat("victim")  # the owner's next beat replaces the garbage
    first = liveness.heartbeat_mark("victim")
    liveness.beat("victim")
    assert first != liveness.heartbeat_mark("victim")


def test_a_forged_newer_round_with_the_same_members_makes_members_rejoin() -> None:
    storage = InMemoryRendezvousStorage()
    handler = _handler(InMemoryBackend(storage))
    handler.next_rendezvous()
    backend = InMemoryBackend(storage)
    found = backend.get_state()
    assert found is not None
    state = decode_state(found[0])
    forged = RendezvousState(state.round + 1000, state.participants)
    assert backend.set_state(encode_state(forged), found[1]) is not None
    assert handler.num_nodes_waiting() >= 1
    info = handler.next_rendezvous()
    assert info.world_size == 1
    handler.close()


def test_a_missing_secret_file_is_a_value_error_naming_the_key(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    params = RendezvousParameters("c10d", "h:1", "job", 1, 1, auth_token_file=str(missing))
    with pytest.raises(ValueError, match=f"auth_token_file '{missing}' cannot be read"):
        StoreBackendOptions.from_params(params)


class DeafBeats(InMemoryBackend):
    """This node's heartbeats never land: the backend refuses them."""

    def beat(self, node: str) -> None:
        raise RendezvousConnectionError("injected: the heartbeat was refused")


@pytest.mark.slow
def test_a_node_whose_heartbeats_gave_up_completes_no_round() -> None:
    # Traced in a chaos run: a member cut off from Redis sealed a round, its
    # keep-alive gave up, and when the cut healed it still completed the
    # round, which the others were bound to judge it dead in.
    storage = InMemoryRendezvousStorage()
    store = HashStore(timeout=5)
    settings: dict[str, Any] = {
        "timeout": RendezvousTimeout(join=3, last_call=0.05),
        "keep_alive_interval": 0.05,
    }
    deaf = DynamicRendezvousHandler.from_backend(
        "job", store, DeafBeats(storage), 2, 2, "deaf", **settings
    )
    other = DynamicRendezvousHandler.from_backend(
        "job", store, InMemoryBackend(storage), 2, 2, "other", **settings
    )
    with ThreadPoolExecutor(2) as pool:
        try:
            joined = pool.submit(deaf.next_rendezvous)
            deadline = time.monotonic() + 30  # a generous bound: three beats of 0.05 s
            while deaf.statistics().keepalive_error is None:
                assert time.monotonic() < deadline, "the keep-alive never gave up"
                time.sleep(0.01)
            pool.submit(other.next_rendezvous)  # the round can seal now
            with pytest.raises(RendezvousConnectionError, match="failed keep-alive heartbeats"):
                joined.result(timeout=30)
        finally:
            deaf.close()
            other.close()
