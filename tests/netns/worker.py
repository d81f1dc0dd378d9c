"""A worker for jobs across namespaces: record the environment, sleep, exit 0.

``worker.py OUT_DIR SECONDS`` writes ``OUT_DIR/rank<RANK>-restart<N>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

KEYS = (
    "RANK",
    "WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
)

if __name__ == "__main__":
    out = Path(sys.argv[1])
    env = {key: os.environ.get(key, "") for key in KEYS}
    name = f"rank{env['RANK']}-restart{env['TORCHELASTIC_RESTART_COUNT']}.json"
    # Written whole or not at all: the test polls the directory and parses what it finds.
    partial = out / (name + ".partial")
    partial.write_text(json.dumps(env))
    os.replace(partial, out / name)
    time.sleep(float(sys.argv[2]))
