"""``rdzv run`` for schedulers: SLURM's variables, SIGUSR1 to the workers, a readiness file."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.launch.procs import WORKER, agents, envs, finish
from tests.procs import free_port, subprocess_env, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

SLURM = {
    "SLURM_NNODES": "1",
    "SLURM_NODEID": "0",
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "node[01-04]",
}


def test_slurm_variables_fill_the_options_not_given(tmp_path: Path) -> None:
    # The endpoint is given (SLURM's head node does not exist here): it wins.
    endpoint = f"127.0.0.1:{free_port()}"
    args = [f"--rdzv-endpoint={endpoint}", "--local-addr=127.0.0.1", WORKER, str(tmp_path), "ok"]
    with agents() as group:
        code, _, err = finish(group.start(args, env=subprocess_env(**SLURM)))
    assert code == 0, err
    [record] = envs(tmp_path)
    assert record["TORCHELASTIC_RUN_ID"] == "4242"
    assert record["GROUP_WORLD_SIZE"] == "1"
    notice = next(line for line in err.splitlines() if "notice: SLURM" in line)
    assert "--nnodes 1 (SLURM_NNODES), --node-rank 0 (SLURM_NODEID)" in notice
    assert "--rdzv-id 4242 (SLURM_JOB_ID)" in notice
    assert "--rdzv-endpoint" not in notice


def test_pet_variables_and_no_slurm_win_over_slurm(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    args = [f"--rdzv-endpoint={endpoint}", "--local-addr=127.0.0.1", WORKER, str(tmp_path), "ok"]
    with agents() as group:
        env = subprocess_env(**SLURM, PET_RDZV_ID="from-pet")
        code, _, err = finish(group.start(args, env=env))
        assert code == 0, err
        assert envs(tmp_path)[0]["TORCHELASTIC_RUN_ID"] == "from-pet"
        # --no-slurm: nothing from SLURM (the run id is torchrun's default)
        bad = subprocess_env(**{**SLURM, "SLURM_NODEID": "not-a-number"})
        code, _, err = finish(group.start(["--no-slurm", *args], env=bad))
        assert code == 0, err
        assert "notice: SLURM" not in err
        # without it, a bad value is a one-line error naming the variable
        code, _, err = finish(group.start(args, env=bad))
    assert code == 2
    assert err.strip().splitlines()[-1] == (
        "rdzv run: error: SLURM_NODEID='not-a-number' is not a non-negative integer "
        "(--no-slurm ignores SLURM_*)"
    )


def test_sigusr1_reaches_the_workers_and_the_job_goes_on(tmp_path: Path) -> None:
    args = ["--standalone", "--nproc-per-node=2", WORKER, str(tmp_path), "signals"]
    with agents() as group:
        agent = group.start(args)
        wait_until(lambda: len(list(tmp_path.glob("ready-*"))) == 2, what="both workers ready")
        os.kill(agent.pid, signal.SIGUSR1)
        code, _, err = finish(agent)
    assert code == 0, err
    assert [(tmp_path / f"signal-{r}").read_text() for r in (0, 1)] == ["SIGUSR1", "SIGUSR1"]


def test_the_ready_file_exists_while_the_workers_run(tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    ready.write_text("stale from an earlier run")
    args = ["--standalone", f"--ready-file={ready}", WORKER, str(tmp_path), "wait-release"]
    with agents() as group:
        agent = group.start(args)
        wait_until(lambda: len(envs(tmp_path)) == 1, what="the worker")
        wait_until(lambda: ready.exists() and ready.read_text().startswith("{"), what="ready")
        record = json.loads(ready.read_text())
        assert record["group_world_size"] == 1
        assert record["group_rank"] == 0
        (tmp_path / "release-1").write_text("")
        code, _, err = finish(agent)
    assert code == 0, err
    assert not ready.exists()


def test_a_ready_file_in_a_missing_directory_is_an_option_error(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "ready"
    with agents() as group:
        code, _, err = finish(
            group.start(["--standalone", f"--ready-file={missing}", WORKER, str(tmp_path), "ok"])
        )
    assert code == 2
    assert "rdzv run: error: --ready-file" in err
    assert "is not a directory" in err
