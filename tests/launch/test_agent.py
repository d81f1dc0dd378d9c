"""The elastic agent driven by an in-process fake handler, with real worker processes."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from rdzv import PrefixStore, RendezvousInfo
from rdzv.launch import AgentConfig, AgentResult, ElasticAgent, OutputSink, warm
from rdzv.launch.bootstrap import BootstrapSpec
from rdzv.launch.config import EXIT_OK, EXIT_RENDEZVOUS, EXIT_WORKER_FAILED
from rdzv.launch.workers import start_process
from tests.launch.fakes import FakeGroup, FakeHandler, ServerFactory
from tests.launch.procs import envs

WORKER = str(Path(__file__).with_name("worker.py"))

pytestmark = pytest.mark.timeout(60)


class Node:
    """One agent with captured output."""

    def __init__(
        self,
        handler: FakeHandler,
        outdir: Path,
        mode: list[str],
        nproc: int = 2,
        max_restarts: int = 0,
        log_dir: Path | None = None,
        stop_grace: float = 5.0,
    ) -> None:
        self.handler = handler
        self.stdout = io.BytesIO()
        self.stderr = io.BytesIO()
        self.messages: list[str] = []
        self.servers = ServerFactory()
        self.agent = ElasticAgent(
            handler,
            AgentConfig(
                entrypoint=[WORKER, str(outdir), *mode],
                nproc_per_node=nproc,
                max_restarts=max_restarts,
                monitor_interval=0.05,
                log_dir=log_dir,
                local_addr="127.0.0.1",
                stop_grace=stop_grace,
                exit_barrier_timeout=20,
            ),
            bootstrap_factory=self.servers,
            sink=OutputSink(self.stdout, self.stderr),
            log=self.messages.append,
        )

    def run(self) -> AgentResult:
        return self.agent.run()


def run_nodes(nodes: list[Node]) -> list[AgentResult]:
    results: list[AgentResult | None] = [None] * len(nodes)

    def target(i: int) -> None:
        results[i] = nodes[i].run()

    threads = [threading.Thread(target=target, args=(i,)) for i in range(len(nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=50)
    assert all(r is not None for r in results), "an agent did not finish"
    return [r for r in results if r is not None]


def test_two_nodes_two_workers_get_a_consistent_environment(tmp_path: Path) -> None:
    group = FakeGroup(world_size=2)
    nodes = [Node(group.handler(r), tmp_path, ["ok"]) for r in range(2)]
    results = run_nodes(nodes)
    assert [r.exit_code for r in results] == [EXIT_OK, EXIT_OK]
    records = sorted(envs(tmp_path), key=lambda e: int(e["RANK"]))
    assert [int(e["RANK"]) for e in records] == [0, 1, 2, 3]
    port = nodes[0].servers.servers[0].port
    for e in records:
        rank = int(e["RANK"])
        assert e["LOCAL_RANK"] == str(rank % 2)
        assert e["GROUP_RANK"] == str(rank // 2)
        assert e["WORLD_SIZE"] == "4"
        assert e["LOCAL_WORLD_SIZE"] == "2"
        assert e["GROUP_WORLD_SIZE"] == "2"
        assert e["ROLE_NAME"] == "default"
        assert e["ROLE_RANK"] == str(rank)
        assert e["ROLE_WORLD_SIZE"] == "4"
        assert e["MASTER_ADDR"] == "127.0.0.1"
        assert e["MASTER_PORT"] == str(port)
        assert e["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert e["TORCHELASTIC_MAX_RESTARTS"] == "0"
        assert e["TORCHELASTIC_RUN_ID"] == "fake-run"
        assert e["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    # only group rank 0 starts a bootstrap server, and it is closed at the end
    assert len(nodes[0].servers.servers) == 1
    # sized for the round, listening where the agent publishes (local_addr 127.0.0.1)
    assert nodes[0].servers.specs == [BootstrapSpec(world_size=4, nodes=2, listen=("127.0.0.1",))]
    assert nodes[1].servers.servers == []
    assert nodes[0].servers.servers[0].closed
    # the run is closed only after success, and every agent left the rendezvous
    assert group.closed
    assert sum(n.handler.closes for n in nodes) == 1
    assert [n.handler.shutdowns for n in nodes] == [1, 1]


def test_output_is_prefixed_per_rank_and_whole_lines(tmp_path: Path) -> None:
    node = Node(FakeGroup().handler(0), tmp_path, ["partial"], nproc=2)
    assert node.run().exit_code == EXIT_OK
    out = node.stdout.getvalue().decode().splitlines()
    err = node.stderr.getvalue().decode().splitlines()
    for rank in (0, 1):
        assert [line for line in out if line.startswith(f"[rank {rank}]: line")] == [
            f"[rank {rank}]: line {i} from rank {rank}" for i in range(3)
        ]
        assert f"[rank {rank}]: no newline at the end" in out
        assert f"[rank {rank}]: err line from rank {rank}" in err
    assert all(line.startswith(("[rank 0]: ", "[rank 1]: ")) for line in out + err)
    assert len(out) == 8


def test_failed_worker_restarts_then_succeeds(tmp_path: Path) -> None:
    log_dir = tmp_path / "logs"
    node = Node(
        FakeGroup().handler(0), tmp_path, ["fail-once", "1", "3"], max_restarts=2, log_dir=log_dir
    )
    result = node.run()
    assert result.exit_code == EXIT_OK, result.reason
    assert result.restarts == 1
    counts = sorted((int(e["RANK"]), e["TORCHELASTIC_RESTART_COUNT"]) for e in envs(tmp_path))
    assert counts == [(0, "0"), (0, "1"), (1, "0"), (1, "1")]
    assert all(e["TORCHELASTIC_MAX_RESTARTS"] == "2" for e in envs(tmp_path))
    # a fresh bootstrap server per attempt
    servers = node.servers.servers
    assert len(servers) == 2
    assert servers[0].port != servers[1].port
    assert any("worker rank 1" in m and "exited with code 3" in m for m in node.messages)
    # one log file per worker per attempt
    logs = sorted(p.relative_to(log_dir).as_posix() for p in log_dir.rglob("*.log"))
    assert logs == [
        "fake-run/attempt_0/rank_0.log",
        "fake-run/attempt_0/rank_1.log",
        "fake-run/attempt_1/rank_0.log",
        "fake-run/attempt_1/rank_1.log",
    ]
    text = (log_dir / "fake-run/attempt_0/rank_1.log").read_text()
    assert "line 0 from rank 1" in text
    assert "err line from rank 1" in text


def test_restarts_exhausted_names_rank_code_and_log(tmp_path: Path) -> None:
    log_dir = tmp_path / "logs"
    group = FakeGroup()
    node = Node(group.handler(0), tmp_path, ["fail", "1", "7"], max_restarts=1, log_dir=log_dir)
    result = node.run()
    assert result.exit_code == EXIT_WORKER_FAILED
    assert "after 1 restart(s)" in result.reason
    assert "worker rank 1" in result.reason
    assert "exited with code 7" in result.reason
    assert str(log_dir / "fake-run/attempt_1/rank_1.log") in result.reason
    assert result.failure is not None
    assert result.failure.rank == 1
    # restarts exhausted: the run is closed
    assert group.closed


def test_worker_killed_by_signal_is_named(tmp_path: Path) -> None:
    node = Node(FakeGroup().handler(0), tmp_path, ["signal", "0", str(int(signal.SIGKILL))])
    result = node.run()
    assert result.exit_code == EXIT_WORKER_FAILED
    assert "worker rank 0" in result.reason
    assert "killed by signal SIGKILL (9)" in result.reason


def test_failure_stops_the_other_workers(tmp_path: Path) -> None:
    node = Node(FakeGroup().handler(0), tmp_path, ["fail", "0", "5"], nproc=3)
    result = node.run()
    assert result.exit_code == EXIT_WORKER_FAILED
    pids = [int(e["pid"]) for e in envs(tmp_path)]
    assert len(pids) == 3
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_waiting_node_triggers_rerendezvous_without_counting(tmp_path: Path) -> None:
    group = FakeGroup()
    node = Node(group.handler(0), tmp_path, ["sleep-once"], nproc=1, max_restarts=0)

    def announce_waiting() -> None:
        deadline = 200
        while not list(tmp_path.glob("env-*.json")) and deadline:
            threading.Event().wait(0.05)
            deadline -= 1
        group.waiting = 1

    helper = threading.Thread(target=announce_waiting)
    helper.start()
    result = node.run()
    helper.join()
    assert result.exit_code == EXIT_OK, result.reason
    assert result.restarts == 0
    assert group.rounds == 2
    assert [e["TORCHELASTIC_RESTART_COUNT"] for e in envs(tmp_path)] == ["0", "0"]
    assert any("waiting" in m and "not counted" in m for m in node.messages)


def test_spare_node_exits_zero_with_a_clear_message(tmp_path: Path) -> None:
    group = FakeGroup()
    handler = group.handler(0)
    handler.graceful_exit = True
    result = Node(handler, tmp_path, ["ok"]).run()
    assert result.exit_code == EXIT_OK
    assert "spare" in result.reason
    assert "\n" not in result.reason
    assert not group.closed
    assert handler.shutdowns == 1


def test_closed_run_exits_with_rendezvous_code(tmp_path: Path) -> None:
    group = FakeGroup()
    group.closed = True
    result = Node(group.handler(0), tmp_path, ["ok"]).run()
    assert result.exit_code == EXIT_RENDEZVOUS
    assert "closed" in result.reason


def test_agent_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="nproc_per_node"):
        AgentConfig(entrypoint=["x.py"], nproc_per_node=0)
    with pytest.raises(ValueError, match="max_restarts"):
        AgentConfig(entrypoint=["x.py"], max_restarts=-1)
    with pytest.raises(ValueError, match="monitor_interval"):
        AgentConfig(entrypoint=["x.py"], monitor_interval=0)
    with pytest.raises(ValueError, match="entry point"):
        AgentConfig(entrypoint=[])


def test_python_is_the_running_interpreter() -> None:
    assert AgentConfig(entrypoint=["x.py"]).python == sys.executable


class _PeerDiesDuringSetup(FakeHandler):
    """Round 0 claims a second node that never shows up; then a 1-node round."""

    def next_rendezvous(self) -> RendezvousInfo:
        self.joins += 1
        store = PrefixStore(f"round/{self.round}", self.group.store)
        self.round += 1
        if self.round == 1:
            # the missing member is evicted a little later: nodes are "waiting"
            self.timer = threading.Timer(0.3, lambda: setattr(self.group, "waiting", 1))
            self.timer.start()
            return RendezvousInfo(store, 1, 2)
        self.group.waiting = 0
        return RendezvousInfo(store, 0, 1)


def test_member_lost_during_setup_sends_everyone_back_uncounted(tmp_path: Path) -> None:
    group = FakeGroup()
    handler = _PeerDiesDuringSetup(group, 0)
    node = Node(handler, tmp_path, ["ok"], nproc=1)
    result = node.run()
    handler.timer.join()
    assert result.exit_code == EXIT_OK, result.reason
    assert result.restarts == 0
    assert handler.joins == 2
    assert any("changed while the workers were being set up" in m for m in node.messages)
    assert [e["WORLD_SIZE"] for e in envs(tmp_path)] == ["1"]


def test_a_signal_whose_exception_is_swallowed_still_stops_the_agent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SIGTERM lands while the first worker starts, in code that ignores what
    # it raises ("Exception ignored in ...": a __del__, an after-fork hook).
    # The agent must stop all the same, not run on.
    node = Node(FakeGroup().handler(0), tmp_path, ["sleep"], nproc=2, stop_grace=1.0)
    fired: list[bool] = []

    def term_once() -> None:
        if not fired and threading.current_thread() is threading.main_thread():
            fired.append(True)
            os.kill(os.getpid(), signal.SIGTERM)
            sys.stdout.flush()  # a bytecode boundary: the handler runs here

    def start(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        process = start_process(*args, **kwargs)
        _swallowing(term_once)
        return process

    monkeypatch.setattr(warm, "start_process", start)
    result = node.run()
    assert fired
    assert result.exit_code == 128 + signal.SIGTERM, result.reason
    assert "interrupted by SIGTERM" in result.reason


def _swallowing(call: Any) -> None:
    with contextlib.suppress(Exception):  # what an after-fork hook does with an error
        call()
