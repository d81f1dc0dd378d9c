"""Issue 42, item 1: torch's own stores wherever rdzv takes a store.

torch's ``HashStore``, ``TCPStore`` (torch's server, ``is_master=True``) and
``FileStore`` run the backend suite under the c10d backend, and the first and
last the Store suite (torch's server with torch's clients runs it in
tests/conformance/test_stores.py's pairings); rdzv's handler, keep-alive,
confirmation and ``rdzv status`` work over a torch store handed over as
torch's documentation shows; three processes rendezvous over torch's
``TCPStore`` with torch's client only.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as torch_dist

from rdzv import (
    DynamicRendezvousHandler,
    HashStore,
    RendezvousParameters,
    RendezvousTimeout,
)
from rdzv.backends.store import RETAIN_REPLACED, C10dRendezvousBackend
from rdzv.dynamic.handler import create_handler
from rdzv.keys import agent_key
from rdzv.status import HeartbeatTracker, list_runs, read_status
from rdzv.store.foreign import ForeignStore, StoreLike, as_store
from rdzv.store.memory import PrefixStore
from rdzv.store.tcp import TCPStore
from rdzv.testing.clock import FakeClock
from rdzv.testing.conformance import BACKEND_CHECKS, Check
from rdzv.testing.store_conformance import STORE_CHECKS, StoreCapability, StoreCheck
from tests.conformance.test_backends import C10dHarness, run_all
from tests.conformance.test_stores import QUEUE_KEY, TORCH_API, Clients
from tests.conformance.test_stores import run as run_store_check
from tests.procs import Children, free_port, subprocess_env

pytestmark = pytest.mark.timeout(90)

NODE = str(Path(__file__).with_name("torch_store_node.py"))
TIMEOUT = timedelta(seconds=10)


def torch_hash_store() -> Any:
    store = torch_dist.HashStore()  # type: ignore[attr-defined]
    store.set_timeout(TIMEOUT)
    return store


def torch_file_store(path: Path) -> Any:
    store = torch_dist.FileStore(str(path), -1)  # type: ignore[attr-defined]
    store.set_timeout(TIMEOUT)
    return store


@pytest.fixture(scope="module")
def torch_clients(torch_server: Any) -> list[Any]:
    """Clients of torch's server (``is_master=True``: tests/conftest.py), connected once.

    A torch client now and then takes 5 s to connect while others close:
    tests take clients from this pool rather than connect their own.
    """
    return [
        torch_dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1", torch_server.port, is_master=False, timeout=TIMEOUT
        )
        for _ in range(9)
    ]


# -- the suites --------------------------------------------------------------

EACH_BACKEND_CHECK = pytest.mark.parametrize("check", BACKEND_CHECKS, ids=lambda c: c.name)


@EACH_BACKEND_CHECK
def test_backend_suite_on_torchs_hash_store(check: Check) -> None:
    shared = torch_hash_store()
    run_all(check, C10dHarness(as_store(shared), lambda: shared))


@pytest.mark.parametrize("client", ["torch", "rdzv"])
@EACH_BACKEND_CHECK
def test_backend_suite_on_torchs_tcp_store(
    check: Check, client: str, torch_server: Any, torch_clients: list[Any]
) -> None:
    # Each backend on a client of its own (torch's, or rdzv's, which reads
    # torch's server as a torch store is read), under a prefix of its own on
    # the shared server; the suite's corruption goes through the master.
    uid, pool = uuid.uuid4().hex[:10], itertools.cycle(torch_clients)

    def connect() -> StoreLike:
        if client == "torch":
            return torch_dist.PrefixStore(uid, next(pool))  # type: ignore[attr-defined]
        return PrefixStore(uid, TCPStore("127.0.0.1", torch_server.port, timeout=TIMEOUT))

    harness = C10dHarness(
        as_store(torch_dist.PrefixStore(uid, torch_server)),  # type: ignore[attr-defined]
        connect,
    )
    try:
        run_all(check, harness)
    finally:
        harness.close()


@EACH_BACKEND_CHECK
def test_backend_suite_on_torchs_file_store(check: Check, tmp_path: Path) -> None:
    path = tmp_path / "store"
    harness = C10dHarness(as_store(torch_file_store(path)), lambda: torch_file_store(path))
    try:
        run_all(check, harness)
    finally:
        harness.close()


def _store_checks(
    offered: frozenset[StoreCapability], slow: tuple[str, ...] = ()
) -> pytest.MarkDecorator:
    return pytest.mark.parametrize(
        "check",
        [
            pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.name in slow else [])
            for c in STORE_CHECKS
            if c.capability is None or c.capability in offered
        ],
    )


HASH = QUEUE_KEY | TORCH_API | {StoreCapability.SHARED_CLIENT}


@_store_checks(HASH)
def test_store_suite_on_torchs_hash_store(check: StoreCheck) -> None:
    shared = torch_hash_store()
    run_store_check(check, Clients(lambda: as_store(shared), HASH))


# torch's FileStore waits a whole second before a timeout of less.
@_store_checks(frozenset(), slow=("wait_times_out",))
def test_store_suite_on_torchs_file_store(check: StoreCheck, tmp_path: Path) -> None:
    # torch's FileStore has no queues, and its delete_key says True for a
    # missing key: the suite's capabilities QUEUES and DELETE_RESULT.
    path = tmp_path / "store"
    run_store_check(check, Clients(lambda: as_store(torch_file_store(path)), frozenset()))


def test_a_torch_store_is_wrapped_once_and_an_rdzv_store_not_at_all() -> None:
    torch_store = torch_hash_store()
    backend = C10dRendezvousBackend(torch_store, "run")
    assert isinstance(backend.store, ForeignStore)
    assert as_store(backend.store) is backend.store
    assert not backend.store.supports_watch
    with pytest.raises(TypeError, match=r"lacks .*compare_set"):
        C10dRendezvousBackend(object(), "run")  # type: ignore[arg-type]


class _RivalBeforeBodyRead:
    """torch's HashStore, on which ``rival`` runs once right before the next read of a state body."""

    def __init__(self, inner: Any, rival: Callable[[], None]) -> None:
        self._inner = inner
        self._rival = rival
        self.armed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        if self.armed and key.startswith("rdzv.backend/run/state/"):
            self.armed = False
            self._rival()
        result: bytes = self._inner.compare_set(key, expected, desired)
        return result


def test_a_body_gone_before_its_read_is_a_lost_race_not_an_error() -> None:
    """The head a reader read is replaced twice and its body deleted before the body read."""
    shared = torch_hash_store()
    clock = FakeClock()
    rival = C10dRendezvousBackend(shared, "run", clock=clock)
    rival.set_state(b"0")

    def commit() -> None:
        read = rival.get_state()
        assert read is not None
        assert rival.set_state(str(int(read[0]) + 1).encode(), read[1]) is not None

    def two_commits_and_retention() -> None:
        commit()
        commit()
        clock.advance(RETAIN_REPLACED)
        rival.read_token()  # deletes the bodies it replaced, the reader's among them

    view = _RivalBeforeBodyRead(shared, two_commits_and_retention)
    reader = C10dRendezvousBackend(view, "run")
    for expected in (b"3", b"6", b"9"):
        commit()  # a head the reader has not read
        view.armed = True
        found = reader.get_state()
        # Read the other way round (head, then body) the head would still
        # name the deleted body: a false "missing body" corruption error.
        assert found is not None
        assert found[0] == expected
        assert found == rival.get_state()
        assert not view.armed


# -- the handler over a torch store ------------------------------------------


def _rendezvous(
    nodes: int, store: Callable[[], StoreLike], run_id: str
) -> list[tuple[DynamicRendezvousHandler, Any]]:
    """``nodes`` rdzv handlers built as torch's documentation shows, one round; (handler, info)."""
    handlers = []
    for _ in range(nodes):
        client = store()
        handlers.append(
            DynamicRendezvousHandler.from_backend(
                run_id,
                client,
                C10dRendezvousBackend(client, run_id),
                nodes,
                nodes,
                "127.0.0.1",
                RendezvousTimeout(join=60, last_call=0.1),
                keep_alive_interval=0.1,
            )
        )
    found: dict[int, Any] = {}

    def join(index: int) -> None:
        found[index] = handlers[index].next_rendezvous()

    threads = [threading.Thread(target=join, args=(i,), daemon=True) for i in range(nodes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=75)
    assert len(found) == nodes, "a node did not complete its round"
    return [(handlers[i], found[i]) for i in range(nodes)]


def test_a_round_over_torchs_tcp_store_with_keep_alive_and_status(
    torch_server: Any, torch_clients: list[Any]
) -> None:
    clients = iter(torch_clients)
    joined = _rendezvous(2, lambda: next(clients), "tcp-run")
    try:
        assert sorted(info.rank for _, info in joined) == [0, 1]
        # The confirmation completed; the round's store is the torch store's.
        for handler, info in joined:
            info.store.set(agent_key(info.rank), json.dumps({"host": f"h{info.rank}"}))
            assert torch_server.get(f"rdzv/tcp-run/round/0/{agent_key(info.rank)}")
            assert handler.statistics().keepalive_error is None
        # rdzv status reads the run, its heartbeats and its agents through a torch client.
        observer = next(clients)
        assert "tcp-run" in list_runs(observer)
        status = read_status(
            C10dRendezvousBackend(observer, "tcp-run"),
            "tcp-run",
            HeartbeatTracker(),
            sample=0.5,
            poll=0.1,
            store=observer,
        )
        assert status.round == 0
        assert [m.host for m in status.members] == ["h0", "h1"]
        assert all(m.heartbeat_age is not None for m in status.members), status.members
    finally:
        for handler, _ in joined:
            handler.shutdown()
            handler.close()


def test_a_round_over_torchs_hash_store() -> None:
    shared = torch_hash_store()
    joined = _rendezvous(3, lambda: shared, "hash-run")
    try:
        assert sorted(info.rank for _, info in joined) == [0, 1, 2]
        assert {info.world_size for _, info in joined} == {3}
    finally:
        for handler, _ in joined:
            handler.shutdown()
            handler.close()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_three_processes_rendezvous_over_torchs_tcp_store_with_torchs_client_only() -> None:
    port = free_port()
    children = Children()
    try:
        procs = [
            children.popen(
                [sys.executable, NODE, str(port), str(int(index == 0)), "three", "3"],
                env=subprocess_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for index in range(3)
        ]
        results = []
        for proc in procs:
            out, err = proc.communicate(timeout=150)
            assert proc.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        children.stop()
    assert sorted(r["rank"] for r in results) == [0, 1, 2]
    assert {r["world_size"] for r in results} == {3}
    # Each saw every rank's key in the round's store.
    assert all(r["ranks_seen"] == [0, 1, 2] for r in results), results


# -- the store a caller passes comes back (issue 51, item 1) ----------------


def _one_node_info(store: Any, run_id: str) -> tuple[Any, Any]:
    params = RendezvousParameters(
        "c10d", "unused:0", run_id, 1, 1, local_addr="127.0.0.1", last_call_timeout="0.1"
    )
    handler = create_handler(store, C10dRendezvousBackend(store, run_id), params)
    return handler, handler.next_rendezvous()


def _train_one_step(store: Any) -> float:
    """init_process_group over ``store`` as torch takes it; one all_reduce."""
    torch_dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        tensor = torch.ones(2)
        torch_dist.all_reduce(tensor)
        return float(tensor.sum())
    finally:
        torch_dist.destroy_process_group()


@pytest.mark.torch
def test_a_torch_hash_store_comes_back_under_torchs_prefix_store() -> None:
    store = torch_hash_store()
    handler, info = _one_node_info(store, "back-hash")
    try:
        assert type(info.store) is torch_dist.PrefixStore  # type: ignore[attr-defined]
        assert info.store.underlying_store is store
        # The same keys as rdzv's view: the round's prefix, then the key.
        info.store.set("probe", "1")
        assert store.get("rdzv/back-hash/round/0/probe") == b"1"
        assert _train_one_step(info.store) == 2.0
    finally:
        handler.shutdown()
        handler.close()


@pytest.mark.torch
def test_a_torch_tcp_store_comes_back_under_torchs_prefix_store(
    torch_clients: list[Any],
) -> None:
    client = torch_clients[0]
    handler, info = _one_node_info(client, f"back-tcp-{uuid.uuid4().hex[:6]}")
    try:
        assert type(info.store) is torch_dist.PrefixStore  # type: ignore[attr-defined]
        assert info.store.underlying_store is client
        assert _train_one_step(info.store) == 2.0
    finally:
        handler.shutdown()
        handler.close()


def test_an_rdzv_store_comes_back_under_rdzvs_prefix_store() -> None:
    store = HashStore()
    handler, info = _one_node_info(store, "back-rdzv")
    try:
        assert isinstance(info.store, PrefixStore)
        assert info.store.underlying_store is store
    finally:
        handler.shutdown()
        handler.close()


def test_create_handler_builds_through_from_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """As torch's does: a patched ``from_backend`` is the one called, with torch's arguments."""
    calls: list[tuple[Any, ...]] = []
    original = DynamicRendezvousHandler.from_backend.__func__  # type: ignore[attr-defined]

    def recording(cls: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(DynamicRendezvousHandler, "from_backend", classmethod(recording))
    store = HashStore()
    params = RendezvousParameters(
        "c10d", "unused:0", "patched", 2, 3, local_addr="10.0.0.1", keep_alive_interval="7"
    )
    handler = create_handler(store, C10dRendezvousBackend(store, "patched"), params)
    try:
        (args,) = calls
        assert args[:6] == ("patched", store, handler.backend, 2, 3, "10.0.0.1")
        assert args[7] == timedelta(seconds=7)
    finally:
        handler.close()
