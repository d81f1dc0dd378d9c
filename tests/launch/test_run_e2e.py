"""``rdzv run`` end to end: real agents, real workers, real TCP stores on loopback."""

from __future__ import annotations

import re
import signal
import socket
from pathlib import Path
from typing import Any

import pytest

from tests.certs import make_tls_files
from tests.launch.procs import ALLREDUCE, HELLO, WORKER, agents, alive, envs, finish, kill_pids
from tests.procs import free_port, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


def last_line(err: str) -> str:
    return err.strip().splitlines()[-1]


def test_standalone_hello_example() -> None:
    with agents() as group:
        code, out, err = finish(group.start(["--standalone", "--nproc-per-node", "2", HELLO]))
    assert code == 0, err
    for rank in (0, 1):
        assert f"[rank {rank}]: hello from rank {rank} of 2" in out
        assert f"[rank {rank}]: rank {rank}: the sum across 2 ranks is 3, as expected" in out
    assert "succeeded" in last_line(err)


def test_two_static_nodes_with_two_workers_each(tmp_path: Path) -> None:
    port = free_port()
    with agents() as group:
        procs = [
            group.start(
                [
                    "--rdzv-backend=static",
                    f"--rdzv-endpoint=127.0.0.1:{port}",
                    "--rdzv-id=job-env",
                    "--nnodes=2",
                    f"--node-rank={rank}",
                    "--nproc-per-node=2",
                    "--local-addr=127.0.0.1",
                    WORKER,
                    str(tmp_path),
                    "ok",
                ]
            )
            for rank in (1, 0)
        ]
        results = [finish(p) for p in procs]
    assert [code for code, _, _ in results] == [0, 0], results
    records = sorted(envs(tmp_path), key=lambda e: int(e["RANK"]))
    assert [e["RANK"] for e in records] == ["0", "1", "2", "3"]
    assert {e["MASTER_PORT"] for e in records} != {str(port)}
    assert len({e["MASTER_PORT"] for e in records}) == 1
    for e in records:
        rank = int(e["RANK"])
        assert (e["GROUP_RANK"], e["LOCAL_RANK"]) == (str(rank // 2), str(rank % 2))
        assert (e["WORLD_SIZE"], e["GROUP_WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) == ("4", "2", "2")
        assert (e["ROLE_RANK"], e["ROLE_WORLD_SIZE"]) == (str(rank), "4")
        assert e["MASTER_ADDR"] == "127.0.0.1"
        assert e["TORCHELASTIC_RUN_ID"] == "job-env"
    node1_out = results[0][1]
    assert "[rank 2]: line 0 from rank 2" in node1_out
    assert "[rank 0]" not in node1_out


def test_two_c10d_agents_over_tls_with_a_secret(tmp_path: Path) -> None:
    files = make_tls_files(tmp_path / "tls")
    token = tmp_path / "token"
    token.write_text("tls e2e secret\n")
    host_conf = f"is_host=true,ssl_cert={files.server_cert},ssl_cert_key={files.server_key}"

    def start(group: Any, port: int, conf: str, ca: str) -> Any:
        return group.start(
            [
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=job-tls",
                "--nnodes=2",
                "--nproc-per-node=1",
                "--local-addr=127.0.0.1",
                f"--rdzv-conf={conf},ca_cert={ca},auth_token_file={token},join_timeout=30",
                HELLO,
            ]
        )

    port = free_port()
    with agents() as group:
        procs = [
            start(group, port, host_conf, files.ca_cert),
            start(group, port, "is_host=false", files.ca_cert),
        ]
        results = [finish(p) for p in procs]
    assert [code for code, _, _ in results] == [0, 0], results
    assert "the sum across 2 ranks is 3, as expected" in results[0][1] + results[1][1]
    # TLS is really on: an agent trusting another CA is refused, naming the certificate.
    port = free_port()
    with agents() as group:
        start(group, port, host_conf, files.ca_cert)
        code, _, err = finish(start(group, port, "is_host=false", files.other_ca_cert))
    assert code != 0
    assert "certificate" in err


def test_failed_worker_is_restarted_with_the_count_visible(tmp_path: Path) -> None:
    args = ["--standalone", "--nproc-per-node=2", "--max-restarts=2"]
    with agents() as group:
        code, _, err = finish(group.start([*args, WORKER, str(tmp_path), "fail-once", "1", "4"]))
    assert code == 0, err
    assert "worker rank 1" in err
    assert "exited with code 4; restarting the group (restart 1/2)" in err
    counts = sorted((e["RANK"], e["TORCHELASTIC_RESTART_COUNT"]) for e in envs(tmp_path))
    assert counts == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
    ports = {e["TORCHELASTIC_RESTART_COUNT"]: e["MASTER_PORT"] for e in envs(tmp_path)}
    assert ports["0"] != ports["1"]


def test_restarts_exhausted_exit_1_naming_rank_code_and_log(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    args = ["--standalone", "--nproc-per-node=2", "--max-restarts=1", f"--log-dir={logs}"]
    with agents() as group:
        code, _, err = finish(group.start([*args, WORKER, str(tmp_path), "fail", "1", "7"]))
    assert code == 1
    line = last_line(err)
    assert "failed after 1 restart(s): worker rank 1" in line
    assert "exited with code 7" in line
    log = line.rsplit("log: ", 1)[1]
    assert Path(log).parent.name == "attempt_1"
    assert "line 0 from rank 1" in Path(log).read_text()


def test_worker_killed_by_signal_is_named(tmp_path: Path) -> None:
    with agents() as group:
        code, _, err = finish(
            group.start(
                ["--standalone", "--nproc-per-node=2", WORKER, str(tmp_path), "signal", "1", "9"]
            )
        )
    assert code == 1
    assert "worker rank 1" in last_line(err)
    assert "was killed by signal SIGKILL (9)" in last_line(err)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_agent_stops_workers(tmp_path: Path, signum: signal.Signals) -> None:
    pids: list[int] = []
    try:
        with agents() as group:
            proc = group.start(
                [
                    "--standalone",
                    "--nproc-per-node=2",
                    "--stop-grace=5",
                    WORKER,
                    str(tmp_path),
                    "sleep",
                ]
            )
            wait_until(lambda: len(envs(tmp_path)) == 2, what="two workers to start")
            pids = [int(e["pid"]) for e in envs(tmp_path)]
            assert all(alive(pid) for pid in pids)
            proc.send_signal(signum)
            code, _, err = finish(proc, timeout=30)
        assert code == 128 + signum
        assert f"interrupted by {signum.name}" in last_line(err)
        wait_until(lambda: not any(alive(pid) for pid in pids), timeout=10, what="workers to end")
    finally:
        kill_pids(pids)


def test_sigkilled_agent_takes_its_workers_along(tmp_path: Path) -> None:
    pids: list[int] = []
    try:
        with agents() as group:
            proc = group.start(
                ["--standalone", "--nproc-per-node=2", WORKER, str(tmp_path), "sleep"]
            )
            wait_until(lambda: len(envs(tmp_path)) == 2, what="two workers to start")
            pids = [int(e["pid"]) for e in envs(tmp_path)]
            proc.kill()
            finish(proc)
        wait_until(lambda: not any(alive(pid) for pid in pids), timeout=10, what="workers to end")
    finally:
        kill_pids(pids)


@pytest.mark.torch
def test_torch_gloo_allreduce_two_static_nodes() -> None:
    port = free_port()
    with agents() as group:
        procs = [
            group.start(
                [
                    "--rdzv-backend=static",
                    f"--rdzv-endpoint=127.0.0.1:{port}",
                    "--nnodes=2",
                    f"--node-rank={rank}",
                    "--nproc-per-node=2",
                    "--local-addr=127.0.0.1",
                    ALLREDUCE,
                ]
            )
            for rank in (0, 1)
        ]
        results = [finish(p, timeout=80) for p in procs]
    assert [code for code, _, _ in results] == [0, 0], results
    out = results[0][1] + results[1][1]
    for rank in range(4):
        assert f"[rank {rank}]: rank {rank}/4" in out
    assert out.count("expected 10.0: ok") == 4


def test_module_entry_point() -> None:
    with agents() as group:
        code, out, err = finish(
            group.start(["--standalone", "--nproc-per-node=2", "-m", "json.tool", "--help"])
        )
    assert code == 0, err
    for rank in (0, 1):
        assert f"[rank {rank}]: usage:" in out


STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} rdzv run: "


def test_agent_lines_are_time_stamped_and_log_level_shows_events(endpoint: str) -> None:
    args = [
        "--nnodes=1",
        f"--rdzv-endpoint={endpoint}",
        "--rdzv-id=job-log-level",
        "--local-addr=127.0.0.1",
        "--log-level=info",
        HELLO,
    ]
    with agents() as group:
        code, _, err = finish(group.start(args))
    assert code == 0, err
    lines = err.strip().splitlines()
    assert all(re.match(STAMP, line) for line in lines), err
    assert any(re.match(STAMP + "node 0/1 starting workers", line) for line in lines)
    assert any(re.match(STAMP + 'INFO rdzv.dynamic: rdzv .*"action": "complete"', x) for x in lines)
    assert re.match(STAMP + ".*succeeded", lines[-1])
    with agents() as group:
        quiet = [a.replace("info", "WARNING").replace("job-log-level", "job-quiet") for a in args]
        code, _, err = finish(group.start(quiet))
    assert code == 0, err
    assert "rdzv.dynamic" not in err


def _join_as_client(port: int, tmp_path: Path) -> tuple[int, str]:
    """Run a one-node job that only joins the store at ``port``: (exit code, stderr)."""
    args = [
        "--nnodes=1",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-conf=is_host=false,read_timeout=2",
        WORKER,
        str(tmp_path),
        "ok",
    ]
    with agents() as group:
        code, _, err = finish(group.start(args))
    return code, err


def test_a_port_held_by_another_program_is_named(tmp_path: Path) -> None:
    with socket.socket() as other:  # accepts connections, never answers
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        code, err = _join_as_client(port, tmp_path)
    assert code == 3, err
    assert last_line(err).endswith(
        f"(a program accepts connections at 127.0.0.1:{port} but did not answer as an rdzv "
        "or torch TCP store: is the port used by another program?)"
    )


def test_an_endpoint_where_nothing_listens_says_so(tmp_path: Path) -> None:
    port = free_port()
    code, err = _join_as_client(port, tmp_path)
    assert code == 3, err
    assert f"(nothing listens at 127.0.0.1:{port}: is the store's host up" in last_line(err)
