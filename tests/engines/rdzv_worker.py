"""A rendezvous agent for the multi-process engine tests.

Joins ``--rounds`` rounds through ``rdzv.create_handler`` and prints one JSON
line per completed round. Between rounds it waits (bounded) until
``num_nodes_waiting() > 0``. ``--close`` closes the run after the last
round; a closed run prints ``{"closed": true, "error": NAME}`` (a node that
is not needed by a closed run exits gracefully).

    python -m tests.engines.rdzv_worker BACKEND ENDPOINT RUN_ID MIN MAX ROUNDS [--close]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import rdzv


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("backend")
    parser.add_argument("endpoint")
    parser.add_argument("run_id")
    parser.add_argument("min_nodes", type=int)
    parser.add_argument("max_nodes", type=int)
    parser.add_argument("rounds", type=int)
    parser.add_argument("--close", action="store_true")
    args = parser.parse_args()
    params = rdzv.RendezvousParameters(
        args.backend,
        args.endpoint,
        args.run_id,
        args.min_nodes,
        args.max_nodes,
        local_addr="127.0.0.1",
        join_timeout=60,
        last_call_timeout=0.5,
        close_timeout=10,
        keep_alive_interval=0.2,
        keep_alive_max_attempt=3,
        read_timeout=10,
    )
    handler = rdzv.create_handler(params)
    try:
        for number in range(args.rounds):
            try:
                info = handler.next_rendezvous()
            except (rdzv.RendezvousClosedError, rdzv.RendezvousGracefulExitError) as exc:
                print(json.dumps({"closed": True, "error": type(exc).__name__}), flush=True)
                return 0
            print(
                json.dumps(
                    {
                        "rank": info.rank,
                        "world_size": info.world_size,
                        "participants": list(info.participants),
                    }
                ),
                flush=True,
            )
            info.store.set(f"rank{info.rank}", b"here")
            if number == args.rounds - 1:
                break
            deadline = time.monotonic() + 60
            while handler.num_nodes_waiting() == 0:
                if time.monotonic() > deadline:
                    print(json.dumps({"error": "nobody waited"}), flush=True)
                    return 1
                time.sleep(0.05)
        if args.close:
            handler.set_closed()
        return 0
    finally:
        handler.shutdown()


if __name__ == "__main__":
    sys.exit(main())
