"""One chaos agent: an elastic node that re-rendezvouses forever.

It joins, records each completed round as one JSON line on stdout, "trains"
for a random while (leaving early when another node waits), and joins again,
like torch's elastic agent restarting its workers. Around each
``next_rendezvous`` it reads the store's epoch key (written by the harness
each time it starts the store host), so a round that straddles a store
restart can be told apart. Lines: ``begin``, ``returned`` (the call returned,
before the epoch read), ``round``, ``error``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import sys
import time
from typing import Any

import rdzv
from rdzv.api import RendezvousParameters
from rdzv.errors import RendezvousError
from rdzv.store.base import Store

EPOCH_KEY = "chaos/epoch"
RUN_ID = "chaos"


def emit(**fields: object) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def emit_error(phase: str, exc: Exception, **fields: object) -> None:
    """One ``error`` line: the phase, the exception's class and its message (cut at 300)."""
    emit(event="error", phase=phase, error=type(exc).__name__, message=str(exc)[:300], **fields)


class _Completions(logging.Handler):
    """Remember the round number of this node's last ``complete`` event."""

    def __init__(self) -> None:
        super().__init__()
        self.round = -1

    def emit(self, record: logging.LogRecord) -> None:
        event = getattr(record, "rdzv_event", None)
        if event is not None and event.get("action") == "complete":
            self.round = int(event["round"])


def read_epoch(store: Store) -> int | None:
    try:
        return int(store.get(EPOCH_KEY))
    except Exception:
        return None


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="c10d")
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--min", type=int, required=True)
    parser.add_argument("--max", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--join", type=float, default=30.0)
    parser.add_argument("--interval", type=float, default=0.3)
    parser.add_argument("--attempts", type=int, default=3)
    parser.add_argument(
        "--hold",
        type=float,
        default=1.5,
        help="longest training stint; 0: stay until another node waits (a steady job)",
    )
    parser.add_argument("--log", default=None, help="write rdzv's debug log to this file")
    args = parser.parse_args()
    if args.log is not None:
        debug = logging.FileHandler(args.log)
        debug.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        rdzv_logger = logging.getLogger("rdzv")
        rdzv_logger.setLevel(logging.DEBUG)
        rdzv_logger.addHandler(debug)
    rng = random.Random(args.seed)
    completions = _Completions()
    logger = logging.getLogger("rdzv.dynamic")
    logger.setLevel(logging.INFO)
    logger.addHandler(completions)
    extra: dict[str, Any] = {"is_host": False} if args.backend == "c10d" else {}
    params = RendezvousParameters(
        args.backend,
        args.endpoint,
        RUN_ID,
        args.min,
        args.max,
        local_addr="127.0.0.1",
        join_timeout=args.join,
        last_call_timeout=0.3,
        keep_alive_interval=args.interval,
        keep_alive_max_attempt=args.attempts,
        read_timeout=5,
        **extra,
    )
    try:
        handler = rdzv.create_handler(params)
    except RendezvousError as exc:
        emit(event="error", phase="start", error=type(exc).__name__, message=str(exc))
        return 3
    node = getattr(handler, "node", "?")
    # The handler's own store: the epoch key lives next to the rendezvous.
    probe: Store = handler.store  # type: ignore[attr-defined]  # test agent
    while True:
        before = read_epoch(probe)
        started = time.monotonic()
        emit(event="begin", node=node, at=time.time())
        try:
            info = handler.next_rendezvous()
        except RendezvousError as exc:
            emit_error("rendezvous", exc, node=node, took=time.monotonic() - started)
            return 3
        took = time.monotonic() - started
        completed_at = time.time()  # before the epoch read, which may wait on the store
        emit(event="returned", node=node, took=took)
        after = read_epoch(probe)
        # The node keys of the sealed round, in rank order (info only has addresses).
        participants = list(handler.round_participants())  # type: ignore[attr-defined]
        emit(
            event="round",
            node=node,
            round=completions.round,
            rank=info.rank,
            world_size=info.world_size,
            participants=participants,
            epoch=after if after == before else None,
            at=completed_at,
            took=took,
        )
        stint_end = time.monotonic() + rng.uniform(0.2, args.hold) if args.hold > 0 else math.inf
        try:
            while time.monotonic() < stint_end and handler.num_nodes_waiting() == 0:
                time.sleep(0.05)
        except RendezvousError as exc:
            emit_error("train", exc, node=node)
            return 3


if __name__ == "__main__":
    sys.exit(main())
