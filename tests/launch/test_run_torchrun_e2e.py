"""torchrun's options and environment, end to end: real ``rdzv run`` agents and workers."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from rdzv.launch.options import add_run_arguments
from rdzv.launch.run import DEFAULT_STOP_GRACE, _stop_grace
from tests.launch.procs import WORKER, agents, envs, finish
from tests.procs import free_port, subprocess_env, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

RECORD_WORKER = str(Path(__file__).with_name("record_worker.py"))


def clean_env(**extra: str) -> dict[str, str]:
    """This tree's environment without the variables torchrun or rdzv would pass on."""
    env = {
        k: v
        for k, v in subprocess_env().items()
        if not k.startswith(("PET_", "TORCH", "OMP_", "CUDA_"))
        and k not in ("PYTHONUNBUFFERED", "PYTHON_EXEC")
    }
    env.update(extra)
    return env


def test_pet_nproc_per_node_sets_the_number_of_workers(tmp_path: Path) -> None:
    env = clean_env(PET_NPROC_PER_NODE="2")
    with agents() as group:
        code, _, err = finish(group.start(["--standalone", WORKER, str(tmp_path), "ok"], env=env))
    assert code == 0, err
    assert sorted(e["RANK"] for e in envs(tmp_path)) == ["0", "1"]
    assert {e["WORLD_SIZE"] for e in envs(tmp_path)} == {"2"}


def test_one_node_without_rendezvous_options_runs_as_torchrun_does(tmp_path: Path) -> None:
    # torchrun's default: the static backend, no endpoint, one node -> a private store.
    with agents() as group:
        code, _, err = finish(group.start(["--nproc-per-node=2", WORKER, str(tmp_path), "ok"]))
    assert code == 0, err
    records = envs(tmp_path)
    assert sorted(e["RANK"] for e in records) == ["0", "1"]
    assert re.fullmatch(r"[0-9a-f-]{36}", records[0]["TORCHELASTIC_RUN_ID"])


def test_static_rendezvous_at_master_addr_and_port(tmp_path: Path) -> None:
    port = free_port()
    with agents() as group:
        procs = [
            group.start(
                [
                    "--nnodes=2",
                    f"--node-rank={rank}",
                    "--master-addr=127.0.0.1",
                    f"--master-port={port}",
                    "--local-addr=127.0.0.1",
                    "--rdzv-id=job-master",
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
    assert [(e["RANK"], e["GROUP_RANK"]) for e in records] == [("0", "0"), ("1", "1")]
    assert {e["TORCHELASTIC_RUN_ID"] for e in records} == {"job-master"}


def test_options_that_cannot_apply_get_a_one_line_notice(tmp_path: Path) -> None:
    args = [
        "--standalone",
        "--start-method=fork",
        "--event-log-handler=console",
        "--logs-specs=custom",
        "--numa-binding=node",
        WORKER,
        str(tmp_path),
        "ok",
    ]
    with agents() as group:
        code, _, err = finish(group.start(args))
    assert code == 0, err
    notices = [line for line in err.splitlines() if "rdzv run: notice: " in line]
    for option in ("--start-method fork", "--event-log-handler console", "--logs-specs custom"):
        assert any(f"notice: {option}: ignored; " in line for line in notices), err
    assert any("--numa-binding node: ignored; rdzv run does not bind" in n for n in notices)
    assert len(notices) == 4


def test_unknown_rdzv_conf_key_is_named_in_a_warning(endpoint: str, tmp_path: Path) -> None:
    args = [
        f"--rdzv-endpoint={endpoint}",
        "--rdzv-id=job-typo",
        "--local-addr=127.0.0.1",
        "--rdzv-conf=join_timout=5,read_timeout=30",
        WORKER,
        str(tmp_path),
        "ok",
    ]
    with agents() as group:
        code, _, err = finish(group.start(args))
    assert code == 0, err
    warnings = [line for line in err.splitlines() if "rdzv run: warning: " in line]
    assert len(warnings) == 1, err
    assert "--rdzv-conf key 'join_timout' is not a setting of the 'c10d' backend" in warnings[0]
    assert "did you mean 'join_timeout'?" in warnings[0]


def test_no_python_runs_the_command_itself(tmp_path: Path) -> None:
    args = ["--standalone", "--nproc-per-node=2", "--no-python", "sh", "-c", "echo rank=$RANK"]
    with agents() as group:
        code, out, err = finish(group.start(args))
    assert code == 0, err
    assert "[rank 0]: rank=0" in out
    assert "[rank 1]: rank=1" in out


def test_run_path_runs_the_script_through_runpy(tmp_path: Path) -> None:
    with agents() as group:
        code, _, err = finish(
            group.start(["--standalone", "--run-path", WORKER, str(tmp_path), "env"])
        )
    assert code == 0, err
    (record,) = [json.loads(p.read_text()) for p in tmp_path.glob("fullenv-*.json")]
    assert "runpy.run_path" in " ".join(record["argv"])
    assert record["argv"][-3:] == [WORKER, str(tmp_path), "env"]


def test_redirects_tee_filters_and_prefix_template(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    args = [
        "--standalone",
        "--rdzv-id=ignored",
        "--nproc-per-node=3",
        f"--log-dir={logs}",
        "--redirects=3",
        "--tee=0:1",
        "--local-ranks-filter=0,2",
        "--duplicate-stdout-filters=line 1,never,,seen",
        "--duplicate-stderr-filters=err line",
        WORKER,
        str(tmp_path),
        "ok",
    ]
    env = clean_env(TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="<${role_name}:${rank}> ")
    with agents() as group:
        code, out, err = finish(group.start(args, env=env))
    assert code == 0, err
    # Everything is redirected; local rank 0's stdout is teed back; rank 1 is filtered out.
    assert "<default:0> line 0 from rank 0" in out
    assert "rank 1" not in out
    assert "rank 2" not in out
    assert "err line from rank" not in err
    (attempt,) = logs.glob("*/attempt_0")
    for rank in range(3):
        text = (attempt / f"rank_{rank}.log").read_text()
        assert f"line 2 from rank {rank}" in text
        assert f"err line from rank {rank}" in text
    filtered = (attempt / "filtered_stdout.log").read_text().splitlines()
    assert sorted(filtered) == [f"<default:{r}> line 1 from rank {r}" for r in range(3)]
    errors = (attempt / "filtered_stderr.log").read_text().splitlines()
    assert sorted(errors) == [f"<default:{r}> err line from rank {r}" for r in range(3)]


def test_redirects_without_a_log_dir_say_where_the_logs_are(tmp_path: Path) -> None:
    with agents() as group:
        code, out, err = finish(
            group.start(["--standalone", "-r", "1", WORKER, str(tmp_path), "ok"])
        )
    assert code == 0, err
    assert "line 0" not in out
    match = re.search(r"the worker log files go to (\S+)", err)
    assert match, err
    logs = Path(match.group(1))
    try:
        (log,) = logs.glob("*/attempt_0/rank_0.log")
        assert "line 0 from rank 0" in log.read_text()
    finally:
        for path in sorted(logs.rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
        logs.rmdir()


def test_workers_get_the_error_file_signals_and_nccl_variables(tmp_path: Path) -> None:
    args = ["--standalone", "--nproc-per-node=2", "--signals-to-handle=SIGTERM,SIGUSR1"]
    with agents() as group:
        code, _, err = finish(group.start([*args, WORKER, str(tmp_path), "ok"], env=clean_env()))
    assert code == 0, err
    records = envs(tmp_path)
    assert {e["TORCHELASTIC_SIGNALS_TO_HANDLE"] for e in records} == {"SIGTERM,SIGUSR1"}
    assert {e["TORCH_NCCL_ASYNC_ERROR_HANDLING"] for e in records} == {"1"}
    files = {e["RANK"]: e["TORCHELASTIC_ERROR_FILE"] for e in records}
    assert files["0"] != files["1"]
    assert all(Path(f).is_absolute() for f in files.values())
    # Without --log-dir the error files live in a private directory removed at the end.
    assert not any(Path(f).parent.exists() for f in files.values())


@pytest.mark.torch
def test_the_failure_line_shows_the_record_root_cause(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    args = ["--standalone", f"--log-dir={logs}", RECORD_WORKER, "bad input 42"]
    with agents() as group:
        code, _, err = finish(group.start(args), timeout=90)
    assert code == 1
    last = err.strip().splitlines()[-1]
    assert "worker rank 0 (local rank 0" in last
    assert "exited with code 1: ValueError: bad input 42 (at " in last
    assert re.search(r"record_worker\.py:\d+ in fail\); log: ", last), last
    (error_file,) = logs.glob("*/attempt_0/rank_0.error.json")
    assert json.loads(error_file.read_text())["message"]["message"] == "ValueError: bad input 42"


def test_workers_inherit_the_agent_stdin(tmp_path: Path) -> None:
    with agents() as group:
        proc = group.start(["--standalone", WORKER, str(tmp_path), "stdin"], stdin=subprocess.PIPE)
        assert proc.stdin is not None
        proc.stdin.write("typed into the agent\n")
        proc.stdin.flush()
        code, _, err = finish(proc)
    assert code == 0, err
    assert (tmp_path / "stdin-0").read_text() == "typed into the agent\n"


@pytest.mark.parametrize(
    ("extra", "sent"),
    [([], signal.SIGTERM), ([], signal.SIGINT), (["--signals-to-handle=SIGUSR1"], signal.SIGUSR1)],
    ids=["SIGTERM", "SIGINT", "SIGUSR1"],
)
def test_the_handled_signal_is_forwarded_to_the_workers(
    tmp_path: Path, extra: list[str], sent: signal.Signals
) -> None:
    args = ["--standalone", "--nproc-per-node=2", *extra, WORKER, str(tmp_path), "signals"]
    with agents() as group:
        proc = group.start(args)
        wait_until(lambda: len(list(tmp_path.glob("ready-*"))) == 2, what="workers to be ready")
        proc.send_signal(sent)
        code, _, err = finish(proc, timeout=30)
    assert code == 128 + sent, err
    assert f"interrupted by {sent.name}" in err.strip().splitlines()[-1]
    for rank in (0, 1):
        assert (tmp_path / f"signal-{rank}").read_text() == sent.name


def test_virtual_local_rank_gives_each_worker_its_device(tmp_path: Path) -> None:
    env = clean_env(CUDA_VISIBLE_DEVICES="4,6,7")
    args = ["--standalone", "--nproc-per-node=3", "--virtual-local-rank"]
    with agents() as group:
        code, _, err = finish(group.start([*args, WORKER, str(tmp_path), "ok"], env=env))
    assert code == 0, err
    seen = sorted((e["RANK"], e["LOCAL_RANK"], e["CUDA_VISIBLE_DEVICES"]) for e in envs(tmp_path))
    assert seen == [("0", "0", "4"), ("1", "0", "6"), ("2", "0", "7")]
    args[1] = "--nproc-per-node=4"
    with agents() as group:
        code, _, err = finish(group.start([*args, WORKER, str(tmp_path), "ok"], env=env))
    assert code == 2
    assert "local rank 3 has no device in CUDA_VISIBLE_DEVICES='4,6,7'" in err


def parse_run(argv: list[str]) -> Any:
    import argparse

    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    return parser.parse_args([*argv, "x.py"])


def test_shutdown_timeout_is_the_stop_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    monkeypatch.delenv("PET_SHUTDOWN_TIMEOUT", raising=False)
    assert _stop_grace(parse_run([])) == DEFAULT_STOP_GRACE
    assert _stop_grace(parse_run(["--shutdown-timeout", "3"])) == 3.0
    assert _stop_grace(parse_run(["--shutdown_timeout", "3", "--stop-grace", "1.5"])) == 1.5
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "4")
    assert _stop_grace(parse_run([])) == 4.0
    monkeypatch.setenv("PET_SHUTDOWN_TIMEOUT", "5")
    assert _stop_grace(parse_run([])) == 5.0


TORCHRUN_VALUE_DIFFERENCES = {
    # Deliberate (docs/launcher.md): a fresh store per attempt on a free port,
    # published as the node's address (rdzv) rather than torch's "localhost".
    "MASTER_ADDR",
    "MASTER_PORT",
    # Random per run in both.
    "TORCHELASTIC_RUN_ID",
    # Both set one per worker; torch's is under a torchelastic_* temporary directory.
    "TORCHELASTIC_ERROR_FILE",
}


@pytest.mark.torch
def test_the_worker_environment_is_torchruns(tmp_path: Path) -> None:
    runs: dict[str, Any] = {}
    for name, command in (
        ("torchrun", ("-m", "torch.distributed.run")),
        ("rdzv", ("-m", "rdzv.cli", "run")),
    ):
        outdir = tmp_path / name
        outdir.mkdir()
        args = ["--standalone", "--nproc-per-node=2", WORKER, str(outdir), "env"]
        with agents() as group:
            code, _, err = finish(group.start(args, env=clean_env(), command=command), timeout=90)
        assert code == 0, (name, err)
        runs[name] = {
            int(p.name.split("-")[1].split(".")[0]): json.loads(p.read_text())
            for p in outdir.glob("fullenv-*.json")
        }
    assert sorted(runs["torchrun"]) == sorted(runs["rdzv"]) == [0, 1]
    for rank in (0, 1):
        theirs, ours = runs["torchrun"][rank], runs["rdzv"][rank]
        assert sorted(ours["env"]) == sorted(theirs["env"])
        differ = {k for k in theirs["env"] if theirs["env"][k] != ours["env"][k]}
        assert differ == TORCHRUN_VALUE_DIFFERENCES, differ
        # The same interpreter command line: python -u worker.py OUTDIR env.
        assert ours["argv"][:3] == theirs["argv"][:3]
        assert ours["argv"][4:] == theirs["argv"][4:] == ["env"]
        assert os.path.basename(ours["env"]["TORCHELASTIC_ERROR_FILE"]).endswith(".json")
