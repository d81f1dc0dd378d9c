"""A framework-free worker for ``rdzv run``.

Every worker prints where it sits in the job, adds ``rank + 1`` to a counter
in the store the launcher hands it (``MASTER_ADDR``/``MASTER_PORT``), waits
at a barrier for all ``WORLD_SIZE`` workers and checks the sum::

    rdzv run --standalone --nproc-per-node 2 examples/hello.py
"""

from __future__ import annotations

import os
import sys

import rdzv


def main() -> int:
    """Run the worker.

    Returns:
        0 when the sum across ranks is right, 1 otherwise.
    """
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    print(
        f"hello from rank {rank} of {world_size} "
        f"(local rank {os.environ['LOCAL_RANK']} of {os.environ['LOCAL_WORLD_SIZE']} "
        f"on node {os.environ['GROUP_RANK']} of {os.environ['GROUP_WORLD_SIZE']}, "
        f"restart {os.environ['TORCHELASTIC_RESTART_COUNT']})"
    )
    store = rdzv.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=60
    )
    try:
        store.add("hello/sum", rank + 1)
        if store.add("hello/arrived", 1) == world_size:
            store.set("hello/all-arrived", "1")
        store.wait(["hello/all-arrived"])
        total = int(store.get("hello/sum"))
    finally:
        store.close()
    expected = world_size * (world_size + 1) // 2
    if total != expected:
        print(f"rank {rank}: the sum across ranks is {total}, expected {expected}")
        return 1
    print(f"rank {rank}: the sum across {world_size} ranks is {total}, as expected")
    return 0


if __name__ == "__main__":
    sys.exit(main())
