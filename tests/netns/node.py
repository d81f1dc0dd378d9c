"""A rendezvous node for partition tests: re-rendezvous until told to stop, report each call.

``node.py BACKEND ENDPOINT LOCAL_ADDR MIN MAX SECONDS`` runs for SECONDS,
printing one JSON line per event: ``round`` (a completed round: its number,
this node's rank, the participants in rank order, when it completed and how
long the call took) and ``error`` (a call raised: in which phase, ``rendezvous`` or ``train``, the
error's type and how long ``next_rendezvous`` took). After a round it "trains" until another node waits (or
up to 1 s), then joins again; after a retryable error it joins again too, so
a node cut off keeps trying and rejoins after healing. Closing errors end it.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

import rdzv
from rdzv.api import RendezvousParameters
from rdzv.errors import RendezvousClosedError, RendezvousError, RendezvousGracefulExitError

JOIN_TIMEOUT = 20.0
READ_TIMEOUT = 3
KEEP_ALIVE = 0.5
ATTEMPTS = 3
HOLD = 1.0


class _Completions(logging.Handler):
    """Remember the round number of this node's last ``complete`` event."""

    def __init__(self) -> None:
        super().__init__()
        self.round = -1

    def emit(self, record: logging.LogRecord) -> None:
        event = getattr(record, "rdzv_event", None)
        if event is not None and event.get("action") == "complete":
            self.round = int(event["round"])


def emit(**fields: Any) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def main() -> int:
    backend, endpoint, local_addr = sys.argv[1:4]
    min_nodes, max_nodes, seconds = int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
    completions = _Completions()
    logger = logging.getLogger("rdzv.dynamic")
    logger.setLevel(logging.INFO)
    logger.addHandler(completions)
    params = RendezvousParameters(
        backend,
        endpoint,
        "partitions",
        min_nodes,
        max_nodes,
        local_addr=local_addr,
        join_timeout=JOIN_TIMEOUT,
        last_call_timeout=0.5,
        keep_alive_interval=KEEP_ALIVE,
        keep_alive_max_attempt=ATTEMPTS,
        read_timeout=READ_TIMEOUT,
    )
    handler = rdzv.create_handler(params)
    node = getattr(handler, "node", "?")
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.monotonic()
        try:
            info = handler.next_rendezvous()
        except (RendezvousClosedError, RendezvousGracefulExitError):
            return 0
        except RendezvousError as exc:
            took = time.monotonic() - started
            emit(
                event="error",
                phase="rendezvous",
                node=node,
                error=type(exc).__name__,
                message=str(exc)[:200],
                took=took,
                at=time.time(),
            )
            time.sleep(0.5)
            continue
        took = time.monotonic() - started
        emit(
            event="round",
            node=node,
            round=completions.round,
            rank=info.rank,
            # The node keys of the sealed round, in rank order (info only has addresses).
            participants=list(handler.round_participants()),  # type: ignore[attr-defined]
            at=time.time(),
            took=took,
        )
        stint_end = time.monotonic() + HOLD
        try:
            while time.monotonic() < stint_end and handler.num_nodes_waiting() == 0:
                time.sleep(0.05)
        except RendezvousError as exc:
            emit(
                event="error",
                phase="train",
                node=node,
                error=type(exc).__name__,
                took=0.0,
                at=time.time(),
            )
    handler.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
