"""One node: rendezvous with rdzv, then a gloo all-reduce over ``as_torch_store(info.store)``.

``gloo_worker.py ENDPOINT STORE_TYPE RUN_ID NODES``; prints a JSON summary.
"""

import json
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from rdzv import DynamicRendezvousHandler, RendezvousParameters, create_handler
from rdzv.torch import as_torch_store


def main() -> int:
    endpoint, store_type, run_id, nodes = sys.argv[1:]
    handler = create_handler(
        RendezvousParameters(
            "c10d",
            endpoint,
            run_id,
            int(nodes),
            int(nodes),
            store_type=store_type,
            read_timeout="30",
            last_call_timeout="0.1",
        )
    )
    try:
        info = handler.next_rendezvous()
        store = as_torch_store(info.store)
        assert isinstance(store, dist.Store)  # type: ignore[attr-defined]
        dist.init_process_group(
            "gloo",
            store=store,
            rank=info.rank,
            world_size=info.world_size,
            timeout=timedelta(seconds=30),
        )
        tensor = torch.tensor([float(info.rank + 1)])
        dist.all_reduce(tensor)
        dist.barrier()
        dist.destroy_process_group()
        # The process group's keys went through the round's prefix.
        keys = info.store.list_keys()
        print(
            json.dumps({"rank": info.rank, "sum": tensor.item(), "keys": keys}),
            flush=True,
        )
        # Leave together: one of the nodes may host the store, and it must
        # outlive the others' last calls (their shutdown included).
        assert isinstance(handler, DynamicRendezvousHandler)
        hosting = getattr(handler.store, "server", None) is not None
        info.store.add("left", 1)
        while info.store.add("left", 0) < info.world_size:
            time.sleep(0.01)
        if not hosting:
            handler.shutdown()
            info.store.add("bye", 1)
        else:
            deadline = time.monotonic() + 30
            while info.store.add("bye", 0) < info.world_size - 1 and time.monotonic() < deadline:
                time.sleep(0.01)
    finally:
        handler.shutdown()
        handler.close()  # type: ignore[attr-defined]
    return 0


if __name__ == "__main__":
    sys.exit(main())
