"""A gloo DDP worker for the node-loss test: ``ddp_worker.py OUTDIR``.

It records its environment in ``OUTDIR/env-<RANK>-<pid>.json`` (with its
parent's pid, the agent), trains a tiny model with
``DistributedDataParallel`` one step at a time, writes
``OUTDIR/stepped-<WORLD_SIZE>-<RANK>`` after a few steps, and stops once
the test creates ``OUTDIR/release-<WORLD_SIZE>`` (every rank decides
together, through an all-reduce, so they run the same number of steps).
Before exiting 0 it checks that every rank holds the same parameters.
"""

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

STEPS_BEFORE_REPORT = 3


def main() -> int:
    outdir = Path(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    record: dict[str, object] = {
        key: os.environ.get(key)
        for key in ("RANK", "WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT")
    }
    record.update(pid=os.getpid(), ppid=os.getppid())
    partial = outdir / f"env-{rank}-{os.getpid()}.json.partial"
    partial.write_text(json.dumps(record))
    os.replace(partial, partial.with_suffix(""))
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    release = outdir / f"release-{world}"
    deadline = time.monotonic() + 120
    steps = 0
    while time.monotonic() < deadline:
        inputs = torch.randn(8, 4) + rank
        optimizer.zero_grad()
        model(inputs).sum().backward()
        optimizer.step()
        steps += 1
        if steps == STEPS_BEFORE_REPORT:
            (outdir / f"stepped-{world}-{rank}").write_text(str(steps))
        stop = torch.tensor([1.0 if release.exists() else 0.0])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item() > 0:
            break
        time.sleep(0.05)
    else:
        return 98
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.zeros_like(weights) for _ in range(world)]
    dist.all_gather(gathered, weights)
    in_sync = all(torch.equal(g, weights) for g in gathered)
    print(f"rank {rank}/{world}: {steps} steps, parameters in sync: {in_sync}", flush=True)
    # DDP's reducer holds the process group: drop it first, so that gloo's
    # threads are joined here and not while the interpreter shuts down,
    # where torch 2.13 aborts now and then ("terminate called without an
    # active exception", SIGABRT, seen once on a loaded machine).
    del model, optimizer
    dist.destroy_process_group()
    return 0 if in_sync else 1


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown for gloo's threads to trip on
