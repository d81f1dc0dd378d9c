"""One node of a rendezvous over a file store: ``file_node.py PATH RUN_ID NODES``.

It joins, writes its rank into the round's store, reads every rank back and
prints a JSON summary; nothing but the file connects the nodes.
"""

import json
import sys

from rdzv import RendezvousParameters, create_handler


def main() -> int:
    path, run_id, nodes = sys.argv[1:]
    params = RendezvousParameters(
        "c10d",
        path,
        run_id,
        int(nodes),
        int(nodes),
        store_type="file",
        read_timeout="30",
        join_timeout="60",
        last_call_timeout="0.1",
    )
    handler = create_handler(params)
    try:
        info = handler.next_rendezvous()
        info.store.set(f"from/{info.rank}", str(info.rank))
        seen = [int(v) for v in info.store.multi_get([f"from/{r}" for r in range(info.world_size)])]
        print(
            json.dumps(
                {
                    "rank": info.rank,
                    "world_size": info.world_size,
                    "participants": list(info.participants),
                    "seen": seen,
                    "backend": handler.get_backend(),
                }
            ),
            flush=True,
        )
    finally:
        # Every node is past next_rendezvous() once multi_get returned.
        handler.shutdown()
        handler.close()  # type: ignore[attr-defined]
    return 0


if __name__ == "__main__":
    sys.exit(main())
