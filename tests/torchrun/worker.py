"""A torchrun worker for the tests: gloo all-reduce of ``rank + 1``, with gates.

Environment (besides torchrun's): ``RDZV_TEST_OUT`` (a directory for
marker files), ``RDZV_TEST_WORLD`` (the world size to compute at; a smaller
round's workers wait to be restarted), ``RDZV_TEST_GATE`` (a file: wait until
it exists before the all-reduce).

torch is imported only once the worker goes on to the all-reduce: a worker
that waits to be restarted (or is killed at the gate) never pays for the
import, which costs seconds of CPU per worker, six workers per round.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

WAIT_LIMIT = 60.0


def main() -> int:
    out = Path(os.environ["RDZV_TEST_OUT"])
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    marker = {"rank": rank, "world": world, "restart": restart, "pid": os.getpid()}
    (out / f"started-{os.getpid()}").write_text(json.dumps(marker))
    deadline = time.monotonic() + WAIT_LIMIT
    gate = os.environ.get("RDZV_TEST_GATE")
    want = int(os.environ.get("RDZV_TEST_WORLD", world))
    while (world < want or (gate and not Path(gate).exists())) and time.monotonic() < deadline:
        time.sleep(0.1)  # the agent restarts this worker (or the test opens the gate)
    if world < want or (gate and not Path(gate).exists()):
        return 3
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    dist.destroy_process_group()
    result = {**marker, "sum": value.item()}
    (out / f"result-{rank}").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
