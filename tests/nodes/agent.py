"""One rendezvous node per process, for the multi-process, chaos and netns tests.

``python -m tests.nodes.agent MODE ...``, with three modes:

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

``loop``
    An elastic node that re-rendezvouses for ``--seconds`` (default:
    forever), like torch's elastic agent restarting its workers: the chaos
    agents and the netns partition nodes. After a round it "trains" for
    ``--hold`` s (with ``--seed``, a random 0.2 to ``--hold`` s; 0: until
    another node waits), leaving early when another node waits, and joins
    again. Lines: ``begin``, ``returned`` (the call returned, before the
    epoch read), ``round`` (its number, rank, world size, participants in
    rank order, epoch, completion time and call duration) and ``error``
    (phase ``start``, ``rendezvous`` or ``train``, the error's class and its
    message; a ``rendezvous`` error has the call's duration). With
    ``--epoch-key``, the store's epoch key (the chaos harness writes it
    each time it starts the store host) is read around each call, so a
    round that straddles a store restart has epoch null. An error ends the
    node with status 3; with ``--retry``, it joins again instead (0.5 s
    after a rendezvous error), so a node cut off rejoins after healing, and
    a closed run ends it with status 0 and no line.
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
from rdzv.api import RendezvousParameters, RendezvousSettings
from rdzv.dynamic.handler import DynamicRendezvousHandler
from rdzv.errors import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
)
from rdzv.registry import open_backend
from rdzv.store.base import Store
from rdzv.store.foreign import as_store

CLOSING = (RendezvousClosedError, RendezvousGracefulExitError)

NEXT_ROUND_PATIENCE = 60.0


def emit(**fields: object) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def emit_error(phase: str, exc: Exception, **fields: object) -> None:
    """One ``error`` line: the phase, the exception's class and its message (cut at 300)."""
    emit(
        event="error",
        phase=phase,
        error=type(exc).__name__,
        message=str(exc)[:300],
        at=time.time(),
        **fields,
    )


class _EventPrinter(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        event = getattr(record, "rdzv_event", None)
        if event is not None:
            emit(event="rdzv", **event)


class _Completions(logging.Handler):
    """Remember the round number of this node's last ``complete`` event."""

    def __init__(self) -> None:
        super().__init__()
        self.round = -1

    def emit(self, record: logging.LogRecord) -> None:
        event = getattr(record, "rdzv_event", None)
        if event is not None and event.get("action") == "complete":
            self.round = int(event["round"])


def _listen(handler: logging.Handler) -> None:
    logger = logging.getLogger("rdzv.dynamic")
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)


def _params(args: argparse.Namespace) -> RendezvousParameters:
    config: dict[str, Any] = {
        "join_timeout": args.join,
        "last_call_timeout": args.last_call,
        "keep_alive_interval": args.interval,
        "keep_alive_max_attempt": args.attempts,
        "read_timeout": args.read_timeout,
    }
    if args.close_timeout is not None:
        config["close_timeout"] = args.close_timeout
    if args.is_host is not None:
        config["is_host"] = args.is_host
    return RendezvousParameters(
        args.backend, args.endpoint, args.run_id, args.min, args.max, local_addr=args.addr, **config
    )


def _dynamic_handler(args: argparse.Namespace) -> DynamicRendezvousHandler:
    params = _params(args)
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
        as_store(info.store).set(f"rank{info.rank}", b"here")
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
        _listen(_EventPrinter())
    handler = _dynamic_handler(args)
    try:
        if args.wait_go:
            emit(event="ready")
            sys.stdin.readline()
        return _rounds(handler, args)
    except CLOSING as exc:
        emit(event="exit", error=type(exc).__name__, message=str(exc))
        return 0
    except RendezvousError as exc:
        emit(event="exit", error=type(exc).__name__, message=str(exc))
        return 3
    finally:
        handler.close()


def _epoch(store: Store, key: str | None) -> int | None:
    if key is None:
        return None
    try:
        return int(store.get(key))
    except Exception:
        return None


def loop(args: argparse.Namespace) -> int:
    if args.log is not None:
        debug = logging.FileHandler(args.log)
        debug.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        rdzv_logger = logging.getLogger("rdzv")
        rdzv_logger.setLevel(logging.DEBUG)
        rdzv_logger.addHandler(debug)
    rng = random.Random(args.seed)
    completions = _Completions()
    _listen(completions)
    try:
        handler = rdzv.create_handler(_params(args))
    except RendezvousError as exc:
        emit_error("start", exc)
        return 3
    node = getattr(handler, "node", "?")
    # The handler's own store: the epoch key lives next to the rendezvous.
    probe: Store = handler.store  # type: ignore[attr-defined]  # test agent
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        before = _epoch(probe, args.epoch_key)
        started = time.monotonic()
        emit(event="begin", node=node, at=time.time())
        try:
            info = handler.next_rendezvous()
        except RendezvousError as exc:
            if args.retry and isinstance(exc, CLOSING):
                return 0
            emit_error("rendezvous", exc, node=node, took=time.monotonic() - started)
            if not args.retry:
                return 3
            time.sleep(0.5)
            continue
        took = time.monotonic() - started
        completed_at = time.time()  # before the epoch read, which may wait on the store
        emit(event="returned", node=node, took=took)
        after = _epoch(probe, args.epoch_key)
        emit(
            event="round",
            node=node,
            round=completions.round,
            rank=info.rank,
            world_size=info.world_size,
            # The node keys of the sealed round, in rank order (info only has addresses).
            participants=list(handler.round_participants()),  # type: ignore[attr-defined]
            epoch=after if after == before else None,
            at=completed_at,
            took=took,
        )
        stint = args.hold if args.seed is None else rng.uniform(0.2, args.hold)
        stint_end = time.monotonic() + stint if args.hold > 0 else math.inf
        try:
            while time.monotonic() < stint_end and handler.num_nodes_waiting() == 0:
                time.sleep(0.05)
        except RendezvousError as exc:
            emit_error("train", exc, node=node)
            if not args.retry:
                return 3
    handler.shutdown()
    return 0


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
        store = as_store(info.store)
        store.set(f"from/{info.rank}", str(info.rank))
        seen = [int(v) for v in store.multi_get([f"from/{r}" for r in range(info.world_size)])]
        # do not leave before everyone read: rank 0 hosts the store
        if store.add("done", 1) == info.world_size:
            store.set("all-done", "1")
        store.wait(["all-done"])
        # rank 0 hosts the store: it stays until the others got their reply
        if info.rank == 0:
            store.wait(["bye"], timeout=20)
            while int(store.get("bye")) < info.world_size - 1:
                time.sleep(0.01)
        else:
            store.add("bye", 1)
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

    node = argparse.ArgumentParser(add_help=False)
    node.add_argument("--backend", default="c10d")
    node.add_argument("--endpoint", required=True)
    node.add_argument("--run-id", default="itest")
    node.add_argument("--min", type=int, required=True)
    node.add_argument("--max", type=int, required=True)
    node.add_argument("--addr", default="127.0.0.1")
    node.add_argument("--is-host", default=None)
    node.add_argument("--join", type=float, default=20.0)
    node.add_argument("--last-call", type=float, default=0.5)
    node.add_argument("--close-timeout", type=float, default=None)
    node.add_argument("--interval", type=float, default=0.2)
    node.add_argument("--attempts", type=int, default=3, help="keep_alive_max_attempt")
    node.add_argument("--read-timeout", type=float, default=10.0)

    dyn = modes.add_parser("dynamic", parents=[node], help="an elastic node, some rounds")
    dyn.add_argument("--rounds", type=int, default=1, help="rounds to take part in")
    dyn.add_argument("--hold", type=float, default=0.0, help="seconds to stay after the last round")
    dyn.add_argument("--close", action="store_true", help="close the run after the last round")
    dyn.add_argument("--close-after", type=float, default=None, help="close the run after S s")
    dyn.add_argument("--clock-skew", type=float, default=0.0)
    dyn.add_argument("--wait-go", action="store_true", help="read a line from stdin before joining")
    dyn.add_argument("--events", action="store_true", help="print the rdzv.dynamic events")
    dyn.set_defaults(run=dynamic)

    again = modes.add_parser("loop", parents=[node], help="an elastic node that rejoins")
    again.add_argument("--seconds", type=float, default=math.inf, help="run for S s")
    again.add_argument("--hold", type=float, default=1.0, help="training stint; 0: until a wait")
    again.add_argument("--seed", type=int, default=None, help="random stints of 0.2 to --hold s")
    again.add_argument("--epoch-key", default=None, help="read this store key around each call")
    again.add_argument("--retry", action="store_true", help="rejoin after an error, do not exit")
    again.add_argument("--log", default=None, help="write rdzv's debug log to this file")
    again.set_defaults(run=loop)

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
