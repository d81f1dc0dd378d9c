"""The ``rdzv`` command line.

Each sub-command lives in its own function ``_cmd_<name>``; ``main`` only
parses arguments and maps errors to exit codes.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import rdzv
from rdzv.auth import resolve_auth_token
from rdzv.launch.run import add_run_arguments
from rdzv.launch.status import add_status_arguments
from rdzv.net import server_tls_context
from rdzv.registry import rendezvous_handler_registry
from rdzv.store.server import (
    DEFAULT_FRAME_TIMEOUT,
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    TCPStoreServer,
)

__all__ = ["main"]


def _cmd_backends(_args: argparse.Namespace) -> int:
    backends = rendezvous_handler_registry.backends()
    if not backends:
        print("no rendezvous backends are registered")
        return 0
    width = max(len(name) for name in backends)
    for name, origin in backends.items():
        print(f"{name:<{width}}  {origin}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from rdzv.launch.run import run_command  # noqa: PLC0415 - keep other commands light

    return run_command(args)


def _serve(args: argparse.Namespace) -> None:
    """Run a store server in the foreground until SIGTERM or SIGINT.

    Prints ``rdzv store listening on HOST:PORT`` once bound. The secret comes
    from ``--auth-token-file`` (surrounding whitespace stripped) or else the
    ``RDZV_AUTH_TOKEN`` environment variable, if set.

    Raises:
        ValueError: Only one of ``--tls-cert`` and ``--tls-key`` was given,
            the token file is empty or a limit is not positive.
        OSError: A file could not be read or the address could not be bound.
    """
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key must be given together")
    token = resolve_auth_token(args.auth_token_file)
    context = None
    if args.tls_cert is not None:
        context = server_tls_context(args.tls_cert, args.tls_key)
    server = TCPStoreServer(
        args.host,
        args.port,
        auth_token=token,
        ssl_context=context,
        max_connections=args.max_connections,
        frame_timeout=args.frame_timeout,
        idle_timeout=args.idle_timeout,
    )

    def announce(srv: TCPStoreServer) -> None:
        shown = f"[{srv.host}]" if ":" in srv.host else srv.host
        extras = [name for name, on in (("auth", token), ("tls", context)) if on is not None]
        suffix = f" ({', '.join(extras)})" if extras else ""
        print(f"rdzv store listening on {shown}:{srv.port}{suffix}", flush=True)

    server.serve(announce)


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        _serve(args)
    except (OSError, ValueError) as exc:
        print(f"rdzv serve: {exc}", file=sys.stderr)
        return 1
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from rdzv.launch.status import status_command  # noqa: PLC0415 - keep other commands light

    return status_command(args)


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser of the ``rdzv`` command.

    Returns:
        The parser, with one sub-parser per command.
    """
    parser = argparse.ArgumentParser(
        prog="rdzv", description="Elastic rendezvous for distributed jobs."
    )
    parser.add_argument("--version", action="version", version=f"rdzv {rdzv.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    backends = commands.add_parser(
        "backends", help="list the registered rendezvous backends and where each came from"
    )
    backends.set_defaults(func=_cmd_backends)
    run = commands.add_parser(
        "run",
        help="start this node's workers of an elastic job (torchrun-compatible options)",
        description="Start this node's workers and keep them in one group with the other "
        "nodes: rdzv run [options] script.py args... | -m module args...",
    )
    add_run_arguments(run)
    run.set_defaults(func=_cmd_run)
    status = commands.add_parser(
        "status",
        help="show a run's round, members with ranks and heartbeat ages, and wait list",
    )
    add_status_arguments(status)
    status.set_defaults(func=_cmd_status)
    serve = commands.add_parser(
        "serve", help="run a TCP store server (torch's TCPStore protocol) until SIGTERM/SIGINT"
    )
    serve.add_argument(
        "--host", default=None, help="address to listen on (default: all, dual stack)"
    )
    serve.add_argument("--port", type=int, default=29400, help="port (0 picks a free one)")
    serve.add_argument(
        "--auth-token-file",
        help="file holding the shared secret clients must know (default: $RDZV_AUTH_TOKEN)",
    )
    serve.add_argument("--tls-cert", help="PEM certificate chain (enables TLS with --tls-key)")
    serve.add_argument("--tls-key", help="PEM private key of --tls-cert")
    serve.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        help="most client connections at once; more are closed (default: %(default)s)",
    )
    serve.add_argument(
        "--frame-timeout",
        type=float,
        default=DEFAULT_FRAME_TIMEOUT,
        help="seconds a started request or the handshake may take (default: %(default)s)",
    )
    serve.add_argument(
        "--idle-timeout",
        type=float,
        default=DEFAULT_IDLE_TIMEOUT,
        help="close connections idle this long, never those blocked in a wait (default: off)",
    )
    serve.set_defaults(func=_cmd_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``rdzv`` command.

    Args:
        argv: The arguments, without the program name; ``sys.argv[1:]`` when None.

    Returns:
        The exit status.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return 2
    status: int = func(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
