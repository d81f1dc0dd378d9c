"""One node: rdzv's dynamic rendezvous over torch's own ``TCPStore``, torch's client only.

``torch_store_node.py PORT IS_MASTER RUN_ID NODES``: the node with
``IS_MASTER`` 1 hosts torch's server (``is_master=True``). The store and the
backend are built as torch's documentation shows
(``C10dRendezvousBackend(store, run_id)`` handed to
``DynamicRendezvousHandler.from_backend``). After the round each node writes
its rank into the round's store and reads every rank's back; prints a JSON
summary.
"""

import json
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from rdzv import DynamicRendezvousHandler, RendezvousTimeout
from rdzv.backends.store import C10dRendezvousBackend


def main() -> int:
    port, is_master, run_id, nodes = sys.argv[1:]
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1",
        int(port),
        is_master=is_master == "1",
        timeout=timedelta(seconds=60),
        wait_for_workers=False,
    )
    handler = DynamicRendezvousHandler.from_backend(
        run_id,
        store,
        C10dRendezvousBackend(store, run_id),
        int(nodes),
        int(nodes),
        "127.0.0.1",
        RendezvousTimeout(join=90, last_call=0.1),
    )
    info = handler.next_rendezvous()
    info.store.set(f"rank{info.rank}", str(info.rank))
    seen = [int(v) for v in info.store.multi_get([f"rank{r}" for r in range(info.world_size)])]
    print(json.dumps({"rank": info.rank, "world_size": info.world_size, "ranks_seen": seen}))
    sys.stdout.flush()
    handler.shutdown()
    handler.close()
    # The master's process serves the store: it waits for the others'
    # last calls (their shutdown and close included).
    if is_master == "1":
        deadline = time.monotonic() + 60
        while info.store.add("bye", 0) < info.world_size - 1 and time.monotonic() < deadline:
            time.sleep(0.01)
    else:
        info.store.add("bye", 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
