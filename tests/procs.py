"""Helpers for tests that start subprocesses."""

from __future__ import annotations

import os
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
ROOT = SRC.parent


def subprocess_env(**extra: str) -> dict[str, str]:
    """Return an environment in which a child ``python`` imports this tree's rdzv."""
    env = dict(os.environ)
    parts = [str(SRC), str(ROOT)]
    if env.get("PYTHONPATH"):
        parts.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env.update(extra)
    return env
