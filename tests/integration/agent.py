"""A minimal elastic agent for integration tests: one rendezvous node per process.

It prints one JSON object per line on stdout: rendezvous events from the
``rdzv.dynamic`` logger (``{"event": "rdzv", ...}``), each completed round
(``{"event": "round", ...}``), and how it ended (``{"event": "exit", ...}``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import rdzv
from rdzv.api import RendezvousParameters
from rdzv.errors import RendezvousError, RendezvousGracefulExitError


def emit(**fields: object) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


class _EventPrinter(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        event = getattr(record, "rdzv_event", None)
        if event is not None:
            emit(event="rdzv", **event)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--run-id", default="itest")
    parser.add_argument("--min", type=int, required=True)
    parser.add_argument("--max", type=int, required=True)
    parser.add_argument("--addr", default="127.0.0.1")
    parser.add_argument("--is-host", default=None)
    parser.add_argument("--join", type=float, default=20.0)
    parser.add_argument("--last-call", type=float, default=0.5)
    parser.add_argument("--interval", type=float, default=0.2)
    parser.add_argument("--rounds", type=int, default=1, help="rounds to take part in")
    parser.add_argument(
        "--hold", type=float, default=0.0, help="seconds to run after the last round"
    )
    parser.add_argument("--close-after", type=float, default=None)
    parser.add_argument("--clock-skew", type=float, default=0.0)
    parser.add_argument(
        "--wait-go", action="store_true", help="read a line from stdin before joining"
    )
    args = parser.parse_args()

    logger = logging.getLogger("rdzv.dynamic")
    logger.setLevel(logging.INFO)
    logger.addHandler(_EventPrinter())
    config: dict[str, object] = {
        "join_timeout": args.join,
        "last_call_timeout": args.last_call,
        "keep_alive_interval": args.interval,
        "keep_alive_max_attempt": 3,
        "read_timeout": 10,
    }
    if args.is_host is not None:
        config["is_host"] = args.is_host
    params = RendezvousParameters(
        "c10d", args.endpoint, args.run_id, args.min, args.max, local_addr=args.addr, **config
    )
    handler = rdzv.create_handler(params)
    if args.clock_skew:
        skew = args.clock_skew
        handler._clock = lambda: time.monotonic() + skew  # type: ignore[attr-defined]
    if args.wait_go:
        emit(event="ready")
        sys.stdin.readline()
    started = time.monotonic()
    if args.rounds == 0 and args.close_after is not None:
        handler.set_closed()
        emit(event="closed")
    try:
        for _ in range(args.rounds):
            info = handler.next_rendezvous()
            assert info.bootstrap_store_info is not None
            emit(
                event="round",
                rank=info.rank,
                world_size=info.world_size,
                participants=list(info.participants),
                master=[
                    info.bootstrap_store_info.master_addr,
                    info.bootstrap_store_info.master_port,
                ],
            )
            run_until = time.monotonic() + args.hold
            while True:
                if args.close_after is not None and time.monotonic() - started >= args.close_after:
                    handler.set_closed()
                    emit(event="closed")
                    args.close_after = None
                waiting = handler.num_nodes_waiting()
                if waiting > 0:
                    emit(event="waiting", count=waiting)
                    break
                if time.monotonic() >= run_until and _ == args.rounds - 1:
                    break
                time.sleep(0.02)
    except RendezvousGracefulExitError as exc:
        emit(event="exit", error=type(exc).__name__, message=str(exc))
        return 0
    except RendezvousError as exc:
        emit(event="exit", error=type(exc).__name__, message=str(exc))
        return 3
    handler.shutdown()
    emit(event="exit", error=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
