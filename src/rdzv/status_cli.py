"""The ``rdzv status`` command: its options, its exit statuses and its output.

What it shows is read and formatted by :mod:`rdzv.status`; this module parses
the command line, opens the backend, picks the table, JSON or the run list,
and redraws with ``--watch``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any, TextIO

from rdzv.backends.base import ListedBackend, RendezvousBackend
from rdzv.dynamic.admission_options import shown_target
from rdzv.endpoint import parse_config
from rdzv.errors import RendezvousError, explained
from rdzv.first_failure import printable
from rdzv.status import HeartbeatTracker, RunStatus, format_status, open_backend, read_status

__all__ = ["EXIT_UNKNOWN_RUN", "add_status_arguments", "status_command"]

EXIT_USAGE = 2
EXIT_BACKEND = 3

#: The exit status of ``rdzv status`` for a run the backend does not know.
EXIT_UNKNOWN_RUN = 4


def add_status_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``rdzv status`` to a parser."""
    parser.add_argument("--rdzv-backend", "--rdzv_backend", default="c10d", help="(c10d)")
    parser.add_argument("--rdzv-endpoint", "--rdzv_endpoint", required=True, help="host[:port]")
    parser.add_argument("--rdzv-id", "--rdzv_id", help="the run id (required without --list-runs)")
    parser.add_argument("--rdzv-conf", "--rdzv_conf", default="", help="backend settings k=v,...")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--list-runs",
        action="store_true",
        help="list the runs the store holds, with their rounds (store backends: c10d, ...)",
    )
    parser.add_argument(
        "--sample", type=float, default=2.0, help="seconds to watch heartbeats before answering (2)"
    )
    parser.add_argument(
        "--watch",
        type=float,
        nargs="?",
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="refresh every SECONDS (2) until interrupted or the job ends",
    )


def _error(message: str) -> None:
    print(f"rdzv status: {message}", file=sys.stderr)


def _runs_text(backend: RendezvousBackend) -> str:
    """Say which runs are kept beside an unknown one, when the backend lists them."""
    if not isinstance(backend, ListedBackend):
        return "it has no state and no node is queued"
    try:
        runs = backend.runs()
    except RendezvousError as exc:
        return f"listing the runs failed: {exc}"
    if not runs:
        return "the store holds no run"
    return "runs there: " + ", ".join(printable(repr(r)) for r in runs)


def _list_runs(backend: RendezvousBackend, args: argparse.Namespace, out: TextIO) -> int:
    if not isinstance(backend, ListedBackend):
        _error(
            f"error: --list-runs reads the store backends (c10d, p10d, core, tcp), "
            f"not {args.rdzv_backend!r}"
        )
        return EXIT_USAGE
    rows = [read_status(backend.of_run(r), r, HeartbeatTracker()) for r in backend.runs()]
    if args.json:
        print(json.dumps([_summary(r) for r in rows], sort_keys=True), file=out)
    elif not rows:
        print("no runs", file=out)
    for status in [] if args.json else rows:
        print(_summary_line(status), file=out)
    return 0


def _summary(status: RunStatus) -> dict[str, Any]:
    live = sum(1 for m in status.members if not m.evicted)
    return {
        "run_id": status.run_id,
        "round": status.round,
        "closed": status.closed,
        "members": live,
        "waiting": len(status.waiting),
    }


def _summary_line(status: RunStatus) -> str:
    data = _summary(status)
    where = f"round {status.round}" if status.complete else "no round yet"
    state = "closed" if status.closed else "open"
    return (
        f"{printable(status.run_id)}: {where}, {state}, {data['members']} member(s), "
        f"{data['waiting']} waiting"
    )


_REDRAW = "\x1b[H\x1b[J"


def status_command(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run ``rdzv status``.

    With ``--watch`` the table is redrawn in place when the output is a
    terminal, and the command ends with 0 and ``job finished`` once the
    run is closed (the state is read every 0.1 s while watching, so the
    close is seen before the job's store host goes away).

    Args:
        args: The parsed options.
        out: Where the status goes (stdout when None).

    Returns:
        0, 2 for bad options, 3 when the backend cannot be read, 4
        (:data:`EXIT_UNKNOWN_RUN`) when the run is unknown.
    """
    out = out or sys.stdout
    if args.sample < 0 or (args.watch is not None and not args.watch > 0):
        _error("error: --sample and --watch must be positive")
        return EXIT_USAGE
    if not args.rdzv_id and not args.list_runs:
        _error("error: --rdzv-id is required (or --list-runs)")
        return EXIT_USAGE
    run_id = "rdzv-status" if args.list_runs else args.rdzv_id
    try:
        backend, store, close = open_backend(
            args.rdzv_backend, args.rdzv_endpoint, run_id, parse_config(args.rdzv_conf)
        )
    except ValueError as exc:
        _error(f"error: {explained(exc)}")
        return EXIT_USAGE
    except RendezvousError as exc:
        _error(f"cannot reach the backend: {exc}")
        return EXIT_BACKEND
    target = shown_target(parse_config(args.rdzv_conf), os.environ)
    redraw = args.watch is not None and not args.json and out.isatty()
    tracker = HeartbeatTracker()
    run = printable(repr(args.rdzv_id))
    try:
        if args.list_runs:
            return _list_runs(backend, args, out)
        while True:
            sample = args.sample if args.watch is None else args.watch
            status = read_status(backend, args.rdzv_id, tracker, sample, store=store)
            status = dataclasses.replace(status, target_nodes=target)
            if not status.known and args.watch is None:
                _error(f"run {run} is unknown to the backend: {_runs_text(backend)}")
                return EXIT_UNKNOWN_RUN
            if args.json:
                print(json.dumps(status.to_json(), sort_keys=True), file=out, flush=True)
            else:
                text = format_status(status)
                if not status.known:
                    text += f"run {run} is unknown so far ({_runs_text(backend)})\n"
                print((_REDRAW if redraw else "") + text, end="", file=out, flush=True)
            if args.watch is None:
                return 0
            if status.closed:
                print(f"run {run}: job finished (the run is closed)", file=out, flush=True)
                return 0
    except RendezvousError as exc:
        _error(f"{type(exc).__name__}: {exc}")
        return EXIT_BACKEND
    except KeyboardInterrupt:
        if args.list_runs:
            raise
        return 0
    finally:
        close()
