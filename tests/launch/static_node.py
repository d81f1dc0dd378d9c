"""One node of a static rendezvous: ``static_node.py HOST PORT RANK WORLD_SIZE TIMEOUT``.

Nothing is hosted before ``next_rendezvous()``, so the caller picks the port.
After the barrier each node writes its rank into the round's store,
reads everyone's back and prints a JSON summary; a timeout prints the error
and exits 3.
"""

import json
import sys
import time

from rdzv import RendezvousTimeoutError, StaticTCPRendezvous


def main() -> int:
    host, port, rank, world_size, timeout = sys.argv[1:]
    handler = StaticTCPRendezvous(
        host,
        master_port=int(port),
        rank=int(rank),
        world_size=int(world_size),
        run_id="static-test",
        timeout=float(timeout),
    )
    try:
        try:
            info = handler.next_rendezvous()
        except RendezvousTimeoutError as exc:
            print(f"timeout: {exc}", flush=True)
            return 3
        info.store.set(f"from/{info.rank}", str(info.rank))
        seen = [int(v) for v in info.store.multi_get([f"from/{r}" for r in range(info.world_size)])]
        # do not leave before everyone read: rank 0 hosts the store
        if info.store.add("done", 1) == info.world_size:
            info.store.set("all-done", "1")
        info.store.wait(["all-done"])
        # rank 0 hosts the store: it stays until the others got their reply
        if info.rank == 0:
            info.store.wait(["bye"], timeout=20)
            while int(info.store.get("bye")) < info.world_size - 1:
                time.sleep(0.01)
        else:
            info.store.add("bye", 1)
        boot = info.bootstrap_store_info
        print(
            json.dumps(
                {
                    "rank": info.rank,
                    "world_size": info.world_size,
                    "seen": seen,
                    "master": [boot.master_addr, boot.master_port] if boot else None,
                }
            ),
            flush=True,
        )
    finally:
        handler.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
