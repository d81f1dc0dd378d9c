"""A training worker for jobs across namespaces: gloo all-reduce steps, resumed from a checkpoint.

Environment (besides the launcher's): ``RDZV_TEST_OUT`` (a directory),
``RDZV_TEST_HOST`` (the index of the host whose agent started it).

Each step all-reduces ``[rank + 1, stop]`` and adds the first element's sum
to the model's one weight; ``stop`` is 1 on rank 0 once the file
``OUT/stop`` exists, so every rank ends at the same step and exits 0. After
each step every worker appends one JSON line (host, group rank, rank, world,
restart, step, weight, pid) to ``OUT/steps-<host>.jsonl`` and rank 0 writes
``OUT/checkpoint.json`` (step, weight), which a new group resumes from: a
group re-formed after a node loss goes on from the last step, not from 0.
A worker still running after ``TIME_LIMIT`` seconds exits 1.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

TIME_LIMIT = 240.0
STEP_PAUSE = 0.3


def main() -> int:
    out = Path(os.environ["RDZV_TEST_OUT"])
    host = os.environ["RDZV_TEST_HOST"]
    checkpoint = out / "checkpoint.json"
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    state = json.loads(checkpoint.read_text()) if checkpoint.exists() else {"step": 0, "weight": 0}
    step, weight = int(state["step"]), float(state["weight"])
    deadline = time.monotonic() + TIME_LIMIT
    base = {
        "host": int(host),
        "group_rank": int(os.environ["GROUP_RANK"]),
        "rank": rank,
        "world": world,
        "restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
        "pid": os.getpid(),
    }
    while time.monotonic() < deadline:
        stop = float(rank == 0 and (out / "stop").exists())
        values = torch.tensor([float(rank + 1), stop])
        dist.all_reduce(values)
        step += 1
        weight += values[0].item()
        with (out / f"steps-{host}.jsonl").open("a") as log:
            log.write(json.dumps({**base, "step": step, "weight": weight}) + "\n")
        if rank == 0:
            partial = out / "checkpoint.json.partial"
            partial.write_text(json.dumps({"step": step, "weight": weight}))
            os.replace(partial, checkpoint)
        if values[1].item() > 0:
            dist.destroy_process_group()
            return 0
        time.sleep(STEP_PAUSE)
    return 1


if __name__ == "__main__":
    sys.exit(main())
