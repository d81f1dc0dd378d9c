"""One rendezvous node per process, for the multi-process tests.

``python -m tests.nodes.agent MODE ...``, with two modes:

``dynamic``
    An elastic node on any backend (``--backend``, default ``c10d``) through
    ``rdzv.create_handler``. It takes part in ``--rounds`` rounds, writes
    ``rank<N>`` into each round's store, and between rounds waits until
    another node waits. It prints one JSON object per line on stdout: each
    completed round (``{"event": "round", ...}``), ``waiting``, ``closed``,
    ``ready`` (with ``--wait-go``), the ``rdzv.dynamic`` logger's events
    (``{"event": "rdzv", ...}``, with ``--events``), and how it ended
    (``{"event": "exit", "error": NAME or null}``). Exit status: 0, also when
    the run was closed; 3 on another rendezvous error; 1 when nobody waited
    for a next round within 60 s.

``static HOST PORT RANK WORLD_SIZE TIMEOUT``
    One node of a static rendezvous. Nothing is hosted before
    ``next_rendezvous()``, so the caller picks the port. After the barrier
    each node writes its rank into the round's store, reads everyone's back
    and prints a JSON summary; a timeout prints the error and exits 3.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any

import rdzv
from rdzv.api import RendezvousParameters, RendezvousSettings
from rdzv.dynamic.handler import DynamicRendezvousHandler
from rdzv.errors import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
)
from rdzv.registry import open_backend

NEXT_ROUND_PATIENCE = 60.0


def emit(**fields: object) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


class _EventPrinter(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        event = getattr(record, "rdzv_event", None)
        if event is not None:
            emit(event="rdzv", **event)


def _dynamic_handler(args: argparse.Namespace) -> DynamicRendezvousHandler:
    config: dict[str, Any] = {
        "join_timeout": args.join,
        "last_call_timeout": args.last_call,
        "keep_alive_interval": args.interval,
        "keep_alive_max_attempt": 3,
        "read_timeout": 10,
    }
    if args.close_timeout is not None:
        config["close_timeout"] = args.close_timeout
    if args.is_host is not None:
        config["is_host"] = args.is_host
    params = RendezvousParameters(
        args.backend,
        args.endpoint,
        args.run_id,
        args.min,
        args.max,
        local_addr=args.addr,
        **config,
    )
    if not args.clock_skew:
        handler = rdzv.create_handler(params)
        assert isinstance(handler, DynamicRendezvousHandler)
        return handler
    skew = args.clock_skew
    backend, store = open_backend(params)
    return DynamicRendezvousHandler.from_settings(
        RendezvousSettings.from_params(params),
        store,
        backend,
        params.local_addr,
        clock=lambda: time.monotonic() + skew,
    )


def _rounds(handler: DynamicRendezvousHandler, args: argparse.Namespace) -> int:
    started = time.monotonic()
    close_after = args.close_after
    if args.rounds == 0 and close_after is not None:
        handler.set_closed()
        emit(event="closed")
    for number in range(args.rounds):
        info = handler.next_rendezvous()
        info.store.set(f"rank{info.rank}", b"here")
        boot = info.bootstrap_store_info
        emit(
            event="round",
            rank=info.rank,
            world_size=info.world_size,
            participants=list(info.participants),
            master=[boot.master_addr, boot.master_port] if boot else None,
        )
        last = number == args.rounds - 1
        hold_until = time.monotonic() + args.hold
        give_up = time.monotonic() + NEXT_ROUND_PATIENCE
        while True:
            if close_after is not None and time.monotonic() - started >= close_after:
                handler.set_closed()
                emit(event="closed")
                close_after = None
            waiting = handler.num_nodes_waiting()
            if waiting > 0:
                emit(event="waiting", count=waiting)
                break
            if last and time.monotonic() >= hold_until:
                break
            if not last and time.monotonic() >= give_up:
                emit(event="exit", error="nobody waited")
                return 1
            time.sleep(0.02)
    if args.close:
        handler.set_closed()
        emit(event="closed")
    handler.shutdown()
    emit(event="exit", error=None)
    return 0


def dynamic(args: argparse.Namespace) -> int:
    if args.events:
        logger = logging.getLogger("rdzv.dynamic")
        logger.setLevel(logging.INFO)
        logger.addHandler(_EventPrinter())
    handler = _dynamic_handler(args)
    try:
        if args.wait_go:
            emit(event="ready")
            sys.stdin.readline()
        return _rounds(handler, args)
    except (RendezvousClosedError, RendezvousGracefulExitError) as exc:
        emit(event="exit", error=type(exc).__name__, message=str(exc))
        return 0
    except RendezvousError as exc:
        emit(event="exit", error=type(exc).__name__, message=str(exc))
        return 3
    finally:
        handler.close()


def static(args: argparse.Namespace) -> int:
    handler = rdzv.StaticTCPRendezvous(
        args.host,
        master_port=args.port,
        rank=args.rank,
        world_size=args.world_size,
        run_id="static-test",
        timeout=args.timeout,
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


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.nodes.agent")
    modes = parser.add_subparsers(dest="mode", required=True)

    dyn = modes.add_parser("dynamic", help="an elastic node through rdzv.create_handler")
    dyn.add_argument("--backend", default="c10d")
    dyn.add_argument("--endpoint", required=True)
    dyn.add_argument("--run-id", default="itest")
    dyn.add_argument("--min", type=int, required=True)
    dyn.add_argument("--max", type=int, required=True)
    dyn.add_argument("--addr", default="127.0.0.1")
    dyn.add_argument("--is-host", default=None)
    dyn.add_argument("--join", type=float, default=20.0)
    dyn.add_argument("--last-call", type=float, default=0.5)
    dyn.add_argument("--close-timeout", type=float, default=None)
    dyn.add_argument("--interval", type=float, default=0.2)
    dyn.add_argument("--rounds", type=int, default=1, help="rounds to take part in")
    dyn.add_argument("--hold", type=float, default=0.0, help="seconds to stay after the last round")
    dyn.add_argument("--close", action="store_true", help="close the run after the last round")
    dyn.add_argument("--close-after", type=float, default=None, help="close the run after S s")
    dyn.add_argument("--clock-skew", type=float, default=0.0)
    dyn.add_argument("--wait-go", action="store_true", help="read a line from stdin before joining")
    dyn.add_argument("--events", action="store_true", help="print the rdzv.dynamic events")
    dyn.set_defaults(run=dynamic)

    sta = modes.add_parser("static", help="one node of a static rendezvous")
    sta.add_argument("host")
    sta.add_argument("port", type=int)
    sta.add_argument("rank", type=int)
    sta.add_argument("world_size", type=int)
    sta.add_argument("timeout", type=float)
    sta.set_defaults(run=static)

    args = parser.parse_args()
    code: int = args.run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
