"""A worker failure that comes with a change of the group is a re-form, not a restart.

The agent runs real worker processes under the in-process fake handler
(tests/launch/fakes.py), whose ``waiting`` and ``participants`` the tests set.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest

from rdzv import HashStore
from rdzv.dynamic.handler import DynamicRendezvousHandler
from rdzv.launch import AgentConfig
from rdzv.launch.agent import reform_grace
from rdzv.launch.config import EXIT_OK, EXIT_WORKER_FAILED
from rdzv.testing.memory import InMemoryBackend
from tests.launch.fakes import FakeGroup, FakeHandler
from tests.launch.procs import envs
from tests.launch.test_agent import Node

pytestmark = pytest.mark.timeout(60)


def _when(predicate: Callable[[], bool], then: Callable[[], None]) -> threading.Thread:
    """Run ``then()`` in a thread once ``predicate()`` holds (bounded: 20 s)."""

    def watch() -> None:
        deadline = time.monotonic() + 20
        while not predicate() and time.monotonic() < deadline:
            time.sleep(0.02)
        then()

    thread = threading.Thread(target=watch)
    thread.start()
    return thread


def _node(group: FakeGroup, tmp_path: Path, max_restarts: int, grace: float | None) -> Node:
    node = Node(group.handler(0), tmp_path, ["fail-once", "0", "3"], nproc=1)
    config = node.agent._config
    node.agent = type(node.agent)(
        node.handler,
        AgentConfig(
            entrypoint=config.entrypoint,
            nproc_per_node=1,
            max_restarts=max_restarts,
            monitor_interval=0.05,
            local_addr="127.0.0.1",
            stop_grace=5,
            exit_barrier_timeout=20,
            reform_grace=grace,
        ),
        bootstrap_factory=node.servers,
        log=node.messages.append,
    )
    return node


def test_a_failure_with_no_restart_left_reforms_when_the_group_changes(tmp_path: Path) -> None:
    group = FakeGroup()
    node = _node(group, tmp_path, max_restarts=0, grace=30)

    def grace_started() -> bool:
        return any("waiting up to 30 s" in m for m in node.messages)

    def member_evicted() -> None:
        group.waiting = 1

    helper = _when(grace_started, member_evicted)
    result = node.run()
    helper.join()
    assert result.exit_code == EXIT_OK, (result.reason, node.messages)
    assert result.restarts == 0
    assert group.rounds == 2
    assert [e["TORCHELASTIC_RESTART_COUNT"] for e in envs(tmp_path)] == ["0", "0"]
    assert node.agent.stats.reforms == 1
    assert any("not counted as a restart" in m for m in node.messages)


def test_a_failure_with_no_restart_left_and_no_change_fails_after_the_grace(
    tmp_path: Path,
) -> None:
    group = FakeGroup()
    node = _node(group, tmp_path, max_restarts=0, grace=0.3)
    result = node.run()
    assert result.exit_code == EXIT_WORKER_FAILED, result.reason
    assert "exited with code 3" in result.reason
    assert group.closed
    assert any("waiting up to 0.3 s" in m for m in node.messages)


def test_a_failure_while_nodes_wait_is_not_counted(tmp_path: Path) -> None:
    group = FakeGroup()
    node = _node(group, tmp_path, max_restarts=0, grace=30)

    def failed() -> bool:
        return (tmp_path / "failed-once").exists()

    def node_waits() -> None:
        group.waiting = 1  # the fake's next round clears it

    # The agent sees the waiting node just before the failure, with it, or
    # within the grace; none of them costs a restart.
    helper = _when(failed, node_waits)
    result = node.run()
    helper.join()
    assert result.exit_code == EXIT_OK, result.reason
    assert result.restarts == 0
    assert group.rounds == 2
    assert any("(not counted as a restart)" in m for m in node.messages)


def test_a_restart_is_given_back_when_the_next_round_has_other_members(tmp_path: Path) -> None:
    group = FakeGroup()
    group.participants = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    node = _node(group, tmp_path, max_restarts=1, grace=0)

    def member_gone(handler: FakeHandler) -> None:
        # The re-join after the worker failed finds a member gone. (A thread
        # that waited for the worker's failure to change the group lost the
        # race against the agent's re-join on a loaded machine.)
        if handler.joins == 1:
            group.participants = ["10.0.0.1", "10.0.0.2"]

    node.handler.before_join = member_gone
    result = node.run()
    assert result.exit_code == EXIT_OK, result.reason
    assert result.restarts == 0
    assert [e["TORCHELASTIC_RESTART_COUNT"] for e in envs(tmp_path)] == ["0", "0"]
    assert any("counts as a re-form, not a restart (restart 0/1)" in m for m in node.messages)


def test_a_restart_with_the_same_members_is_counted(tmp_path: Path) -> None:
    group = FakeGroup()
    group.participants = ["10.0.0.1", "10.0.0.2"]
    node = _node(group, tmp_path, max_restarts=1, grace=0)
    result = node.run()
    assert result.exit_code == EXIT_OK, result.reason
    assert result.restarts == 1
    assert sorted(e["TORCHELASTIC_RESTART_COUNT"] for e in envs(tmp_path)) == ["0", "1"]
    assert node.agent.stats.restarts == 1


def test_the_default_grace_is_the_time_to_find_a_dead_member() -> None:
    store = HashStore()
    handler = DynamicRendezvousHandler.from_backend(
        "run",
        store,
        InMemoryBackend(),
        1,
        2,
        local_addr="127.0.0.1",
        keep_alive_interval=timedelta(seconds=0.5),
        keep_alive_max_attempt=4,
    )
    assert reform_grace(handler) == pytest.approx(2.5)
    assert reform_grace(FakeGroup().handler(0)) == 0.0


def test_a_negative_grace_is_refused() -> None:
    with pytest.raises(ValueError, match="reform_grace"):
        AgentConfig(entrypoint=["x.py"], reform_grace=-1)
