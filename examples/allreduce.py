"""A PyTorch worker for ``rdzv run``: a gloo all-reduce, checked.

``init_process_group(init_method="env://")`` reads the launcher's
``MASTER_ADDR``/``MASTER_PORT`` (a fresh rdzv TCP store per attempt, which
speaks torch's TCPStore protocol), ``RANK`` and ``WORLD_SIZE``::

    rdzv run --standalone --nproc-per-node 2 examples/allreduce.py
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> int:
    """Run the worker.

    Returns:
        0 when the all-reduced tensor is right, 1 otherwise.
    """
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        tensor = torch.full((4,), float(rank + 1))
        dist.all_reduce(tensor)
        expected = float(world_size * (world_size + 1) // 2)
        ok = bool(torch.all(tensor == expected))
        print(
            f"rank {rank}/{world_size} (LOCAL_RANK {os.environ['LOCAL_RANK']}): "
            f"all_reduce -> {tensor.tolist()}, expected {expected}: {'ok' if ok else 'WRONG'}"
        )
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
