"""The static rendezvous: a real barrier across processes, and its timeout."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from rdzv import RendezvousParameters, StaticTCPRendezvous, create_handler
from tests.procs import free_port, subprocess_env

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def nodes() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


def start(procs: list[subprocess.Popen[str]], *args: object) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.nodes.agent", "static", *map(str, args)],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    procs.append(proc)
    return proc


def test_three_processes_meet_at_the_barrier(nodes: list[subprocess.Popen[str]]) -> None:
    port = free_port()
    start(nodes, "127.0.0.1", port, 0, 3, 30)
    start(nodes, "127.0.0.1", port, 2, 3, 30)
    start(nodes, "127.0.0.1", port, 1, 3, 30)
    summaries = []
    for proc in nodes:
        out, err = proc.communicate(timeout=40)
        assert proc.returncode == 0, err
        summaries.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(s["rank"] for s in summaries) == [0, 1, 2]
    for s in summaries:
        assert s["world_size"] == 3
        # every node saw every other node's write: they all were in the same round
        assert s["seen"] == [0, 1, 2]
        assert s["master"] == ["127.0.0.1", port]


@pytest.mark.slow
def test_timeout_names_the_missing_ranks(nodes: list[subprocess.Popen[str]]) -> None:
    # the host waits longer, so its store is still there when the other one gives up
    port = free_port()
    host = start(nodes, "127.0.0.1", port, 0, 4, 3)
    other = start(nodes, "127.0.0.1", port, 2, 4, 1)
    for proc in (host, other):
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 3
        assert "node rank(s) [1, 3] of 4 did not arrive" in out


def test_two_nodes_with_the_same_rank_are_rejected() -> None:
    from rdzv import RendezvousStateError

    port = free_port()
    host = StaticTCPRendezvous("127.0.0.1", master_port=port, rank=0, world_size=2, timeout=5)
    twin = StaticTCPRendezvous("127.0.0.1", master_port=port, rank=1, world_size=2, timeout=5)
    impostor = StaticTCPRendezvous("127.0.0.1", master_port=port, rank=1, world_size=2, timeout=5)
    try:
        import threading

        results: list[object] = []
        thread = threading.Thread(target=lambda: results.append(host.next_rendezvous()))
        thread.start()
        info = twin.next_rendezvous()
        thread.join(timeout=10)
        assert info.rank == 1
        assert info.world_size == 2
        # the impostor's round 0 claim collides with the twin's
        with pytest.raises(RendezvousStateError, match=r"rank 1 .* already taken"):
            impostor.next_rendezvous()
    finally:
        for handler in (impostor, twin, host):
            handler.shutdown()


def test_rounds_are_fresh_and_closing_ends_the_run() -> None:
    from rdzv import RendezvousClosedError

    handler = StaticTCPRendezvous("127.0.0.1", master_port=0, run_id="r", timeout=5)
    try:
        first = handler.next_rendezvous()
        first.store.set("stale", "1")
        second = handler.next_rendezvous()
        assert not second.store.check(["stale"])
        assert handler.num_nodes_waiting() == 0
        assert not handler.is_closed()
        handler.set_closed()
        assert handler.is_closed()
        with pytest.raises(RendezvousClosedError):
            handler.next_rendezvous()
    finally:
        handler.shutdown()


def test_registered_as_static_backend() -> None:
    host = StaticTCPRendezvous("127.0.0.1", master_port=0, timeout=5)
    host.next_rendezvous()  # hosts the store, on a free port
    try:
        params = RendezvousParameters(
            "static", f"127.0.0.1:{host.port}", "r", 2, 2, node_rank=1, timeout="7"
        )
        handler = create_handler(params)
        try:
            assert isinstance(handler, StaticTCPRendezvous)
            assert handler.get_backend() == "static"
            assert handler.get_run_id() == "r"
            assert handler.use_agent_store
        finally:
            handler.shutdown()
    finally:
        host.shutdown()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": 2, "world_size": 2}, "rank must be in 0..1"),
        ({"world_size": 0}, "world_size must be a positive integer"),
        ({"rank": 1, "world_size": 2, "master_port": 0}, "only rank 0 may host on port 0"),
        ({"timeout": 0}, "timeout must be positive"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StaticTCPRendezvous("127.0.0.1", **kwargs)  # type: ignore[arg-type]


def test_elastic_parameters_are_rejected() -> None:
    with pytest.raises(ValueError, match="min_nodes=1 max_nodes=2"):
        StaticTCPRendezvous(RendezvousParameters("static", "127.0.0.1:1", "r", 1, 2, node_rank=0))


def test_a_group_of_several_nodes_needs_a_rank_given_by_node_rank_or_config() -> None:
    endpoint = "127.0.0.1:1"
    with pytest.raises(ValueError, match=r"^rank is absent in RendezvousParameters\."):
        create_handler(RendezvousParameters("static", endpoint, "r", 2, 2))
    for params in (
        RendezvousParameters("static", endpoint, "r", 2, 2, node_rank=0),
        RendezvousParameters("static", endpoint, "r", 2, 2, rank="1"),
    ):
        assert create_handler(params).get_backend() == "static"
