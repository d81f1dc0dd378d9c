"""The elasticity demo runs end to end: the group grows to 3 and shrinks back to 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.procs import ROOT, subprocess_env


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_elastic_demo_shows_grow_and_shrink() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "elastic_demo.py")],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rounds seen: 2 -> 3 -> 2" in done.stdout
    assert "agent B: killed with SIGKILL" in done.stdout
    assert "not counted as a restart" in done.stdout
