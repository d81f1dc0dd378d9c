"""The coverage-guided fuzzers (atheris) in CI, for a bounded number of runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.fuzz.budget import SCALE
from tests.procs import subprocess_env

pytest.importorskip("atheris")  # in the dev extra; the hypothesis fuzzers cover the rest

RUNS = 20_000


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("target", ["parser", "state"])
def test_coverage_guided_fuzzer_finds_no_crash(target: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.fuzz.atheris_targets",
            target,
            f"-runs={RUNS * SCALE}",
            "-seed=1",
            f"-artifact_prefix={tmp_path}/",
        ],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=170,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"Done {RUNS * SCALE} runs" in result.stderr
    assert not list(tmp_path.glob("crash-*"))
