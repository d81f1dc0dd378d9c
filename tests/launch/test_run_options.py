"""``rdzv run`` option parsing: bad values give a clear error naming them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rdzv.cli import main
from rdzv.launch import AgentConfig
from rdzv.launch.nproc import MAX_NPROC_VARIABLE, NPROC_PER_CPU, local_world_size
from rdzv.launch.options import parse_hang_timeout
from rdzv.launch.run import RunOptionsError, parse_nnodes
from tests.procs import subprocess_env

WORKER = str(Path(__file__).with_name("worker.py"))


@pytest.mark.parametrize(
    ("text", "expected"), [("1", (1, 1)), ("3", (3, 3)), ("1:4", (1, 4)), ("2:2", (2, 2))]
)
def test_parse_nnodes(text: str, expected: tuple[int, int]) -> None:
    assert parse_nnodes(text) == expected


@pytest.mark.parametrize("text", ["0", "a", "3:1", "1:2:3", "", "-1:2", "1:x"])
def test_parse_nnodes_rejects(text: str) -> None:
    with pytest.raises(RunOptionsError, match="--nnodes"):
        parse_nnodes(text)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nnodes", "2:1", "--rdzv-endpoint", "h:1", WORKER], "--nnodes '2:1'"),
        (["--nproc-per-node", "zero", "--standalone", WORKER], "--nproc-per-node 'zero'"),
        (["--nproc_per_node", "0", "--standalone", WORKER], "--nproc-per-node '0'"),
        (["--rdzv-endpoint", "h:1", "--rdzv-conf", "a=1,b", WORKER], "--rdzv-conf 'a=1,b'"),
        (
            ["--rdzv-backend", "c10d", WORKER],
            "--rdzv-endpoint is required with --rdzv-backend c10d",
        ),
        (["--nnodes", "2", "--rdzv-backend", "etcd", WORKER], "--rdzv-endpoint is required"),
        (["--standalone", "--nproc-per-node", "many", WORKER], "--nproc-per-node 'many'"),
        (["--standalone", "-r", "4", WORKER], "-r/--redirects '4' is neither 0-3"),
        (["--standalone", "--tee", "0:1,x", WORKER], "-t/--tee '0:1,x'"),
        (["--standalone", "--local-ranks-filter", "0,a", WORKER], "--local-ranks-filter '0,a'"),
        (["--standalone", "--signals-to-handle", "SIGFOO", WORKER], "'SIGFOO' is not a signal"),
        (["--standalone", "--signals-to-handle", "SIGKILL", WORKER], "'SIGKILL' is not a signal"),
        (["--standalone", "--no-python", "-m", "json.tool"], "--no-python and -m/--module"),
        (["--standalone", "--no-python", "no-such-command-x"], "'no-such-command-x' is not an"),
        (["--standalone", "--run-path", "no/such.py"], "--run-path: the worker script"),
        (["--standalone", "--stop-grace", "-1", WORKER], "--stop-grace -1 must be non-negative"),
        (["--standalone", "--hang-timeout", "0", WORKER], "--hang-timeout 0 must be positive"),
        (["--standalone", "--hang-timeout", "-2", WORKER], "--hang-timeout -2 must be"),
        (["--standalone", "--hang-timeout", "nan", WORKER], "--hang-timeout nan must be"),
        (["--standalone", "--hang-timeout", "inf", WORKER], "--hang-timeout inf must be"),
        (["--standalone", "--shutdown-timeout", "-3", WORKER], "--shutdown-timeout -3 must be"),
        (["--standalone", "no/such/script.py"], "'no/such/script.py' does not exist"),
        (["--standalone", "--max-restarts", "-1", WORKER], "--max-restarts -1"),
        (["--standalone", "--monitor-interval", "0", WORKER], "--monitor-interval 0"),
        (["--standalone", "--monitor-interval", "inf", WORKER], "--monitor-interval inf must"),
        (["--standalone", "--monitor-interval", "nan", WORKER], "--monitor-interval nan must"),
        (["--standalone", "--monitor-interval", "1e12", WORKER], "up to 1,000,000,000"),
        (["--standalone", "--stop-grace", "inf", WORKER], "--stop-grace inf must"),
        (["--standalone", "--stop-grace", "nan", WORKER], "--stop-grace nan must"),
        (["--standalone", "--shutdown-timeout", "10" * 11, WORKER], "--shutdown-timeout 1010"),
        (["--standalone", "--reform-grace", "inf", WORKER], "--reform-grace inf must"),
        (["--standalone", "--reform-grace", "nan", WORKER], "--reform-grace nan must"),
        (["--standalone", "--hang-timeout", "1e300", WORKER], "--hang-timeout 1e+300 must"),
        (["--nnodes", "65537", "--rdzv-endpoint", "h:1", WORKER], "more than 65,536 nodes"),
        (["--nnodes", "2:70000", "--rdzv-endpoint", "h:1", WORKER], "more than 65,536 nodes"),
        (["--standalone", "--nproc-per-node", "1000000000", WORKER], "RDZV_MAX_NPROC_PER_NODE"),
        (["--standalone", "--nnodes", "2", WORKER], "--standalone runs one node"),
        (
            ["--rdzv-backend", "nosuch", "--rdzv-endpoint", "h:1", WORKER],
            "'nosuch' is not registered",
        ),
        (["--rdzv-endpoint", "h:1", "--node-rank", "-2", WORKER], "--node-rank -2"),
    ],
)
def test_bad_options_exit_2_naming_the_value(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.startswith("rdzv run: error:")


def test_underscore_and_dash_names_are_both_accepted() -> None:
    from rdzv.cli import build_parser

    parser = build_parser()
    a = parser.parse_args(["run", "--nproc_per_node", "3", "--rdzv_backend", "x", "s.py", "--y"])
    b = parser.parse_args(["run", "--nproc-per-node", "3", "--rdzv-backend", "x", "s.py", "--y"])
    assert a == b
    assert a.training_script_args == ["--y"]


def test_module_mode_takes_the_module_and_its_args() -> None:
    from rdzv.cli import build_parser

    args = build_parser().parse_args(["run", "--standalone", "-m", "pkg.mod", "--lr", "1"])
    assert args.module
    assert args.training_script == "pkg.mod"
    assert args.training_script_args == ["--lr", "1"]


@pytest.mark.parametrize(
    ("value", "message"),
    [("inf", "must be positive"), ("-1", "must be positive"), ("1e9", None), ("0.01", None)],
)
def test_the_agent_config_takes_finite_seconds_up_to_a_billion(
    value: str, message: str | None
) -> None:
    seconds: Any = float(value)
    fields = ("monitor_interval", "stop_grace", "reform_grace", "hang_timeout")
    for name in fields:
        if message is None:
            config = AgentConfig(entrypoint=["x.py"], **{name: seconds})
            assert getattr(config, name) == seconds
            continue
        positive = name in ("monitor_interval", "hang_timeout")
        with pytest.raises(ValueError, match=rf"^{name} must be {'' if positive else 'non-'}"):
            AgentConfig(entrypoint=["x.py"], **{name: seconds})


def test_nproc_per_node_is_refused_over_the_limit_which_a_variable_sets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(MAX_NPROC_VARIABLE, raising=False)
    limit = max(64, NPROC_PER_CPU * len(os.sched_getaffinity(0)))
    assert local_world_size(str(limit)) == limit
    with pytest.raises(RunOptionsError, match=f"at most {limit:,} .*{MAX_NPROC_VARIABLE}=N"):
        local_world_size(str(limit + 1))
    monkeypatch.setenv(MAX_NPROC_VARIABLE, str(limit + 1))
    assert local_world_size(str(limit + 1)) == limit + 1
    monkeypatch.setenv(MAX_NPROC_VARIABLE, "2")
    with pytest.raises(RunOptionsError, match=f"'3' is more than {MAX_NPROC_VARIABLE}=2"):
        local_world_size("3")
    for bad in ("0", "x", ""):
        monkeypatch.setenv(MAX_NPROC_VARIABLE, bad)
        with pytest.raises(RunOptionsError, match=f"{MAX_NPROC_VARIABLE}={bad!r} is not"):
            local_world_size("1")
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    monkeypatch.setenv(MAX_NPROC_VARIABLE, str(pid_max + 1))
    with pytest.raises(RunOptionsError, match=f"at most {pid_max:,} \\(kernel.pid_max\\)"):
        local_world_size(str(pid_max + 1))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--monitor-interval", "inf"], {}, "--monitor-interval inf must be positive"),
        (["--nnodes", "1" + "0" * 30], {}, "more than 65,536 nodes, the most a round holds"),
        (["--nproc-per-node", "1000000000"], {}, "set RDZV_MAX_NPROC_PER_NODE=N to allow N"),
        (
            ["--nproc-per-node", "1000000000"],
            {"RDZV_MAX_NPROC_PER_NODE": "1000000000"},
            "this machine runs at most",
        ),
        (["--stop-grace", "inf"], {}, "--stop-grace inf must be non-negative"),
        (["--reform-grace", "inf"], {}, "--reform-grace inf must be non-negative"),
        (["--hang-timeout", "inf"], {}, "--hang-timeout inf must be positive"),
        ([], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "inf"}, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT='inf'"),
    ],
)
def test_the_cli_refuses_a_bad_value_in_one_line_with_status_2(
    argv: list[str], env: dict[str, str], message: str
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "rdzv", "run", "--standalone", *argv, WORKER],
        env=subprocess_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("rdzv run: error: "), result.stderr
    assert message in result.stderr


def test_parse_hang_timeout_keeps_a_positive_value_or_none() -> None:
    assert parse_hang_timeout(None) is None
    assert parse_hang_timeout(0.5) == 0.5
    with pytest.raises(RunOptionsError, match="--hang-timeout"):
        parse_hang_timeout(0.0)


def test_agent_config_refuses_a_bad_hang_timeout() -> None:
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="hang_timeout"):
            AgentConfig(entrypoint=["x.py"], hang_timeout=bad)
    assert AgentConfig(entrypoint=["x.py"], hang_timeout=30.0).hang_timeout == 30.0
