"""The ``rdzv`` command line.

Each sub-command lives in its own function ``_cmd_<name>``; ``main`` only
parses arguments and maps errors to exit codes.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import ssl
import sys
from collections.abc import Callable, Iterator, Sequence

import rdzv
from rdzv.endpoint import format_endpoint
from rdzv.launch.options import add_run_arguments
from rdzv.metrics import Family, MetricsServer, counter, gauge
from rdzv.registry import rendezvous_handler_registry
from rdzv.status_cli import add_status_arguments
from rdzv.store.serve import ServerSecurity, secured_server
from rdzv.store.server import (
    DEFAULT_FRAME_TIMEOUT,
    DEFAULT_HANDSHAKE_TIMEOUT,
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_HANDSHAKES,
    EVENT_LOOPS,
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


@contextlib.contextmanager
def _warnings_to_stderr(prog: str) -> Iterator[None]:
    """Print the ``rdzv`` loggers' warnings and errors on stderr, time-stamped.

    The library only has a ``NullHandler``; the command line is the
    application that decides where its log records go.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(
            f"%(asctime)s.%(msecs)03d {prog}: %(levelname)s %(name)s: %(message)s",
            "%Y-%m-%d %H:%M:%S",
        )
    )
    handler.setLevel(logging.WARNING)
    logger = logging.getLogger("rdzv")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


def _server_metrics(server: TCPStoreServer) -> Callable[[], list[Family]]:
    """Return the collect function of ``rdzv serve --metrics-port``."""

    def collect() -> list[Family]:
        return [
            gauge("rdzv_store_connections", "open client connections", server.connection_count()),
            counter(
                "rdzv_store_connections_accepted_total",
                "client connections accepted",
                server.accepted_connections,
            ),
            counter(
                "rdzv_store_connections_refused_total",
                "client connections closed at once: max_connections was reached",
                server.refused_connections,
            ),
            counter(
                "rdzv_store_connections_expired_total",
                "client connections closed for breaking the frame or idle timeout",
                server.expired_connections,
            ),
            counter("rdzv_store_requests_total", "requests received", server.requests),
            gauge("rdzv_store_waiters", "requests blocked in wait or watch", server.waiter_count()),
        ]

    return collect


def _serve(args: argparse.Namespace) -> None:
    """Run a store server in the foreground until SIGTERM or SIGINT.

    Prints ``rdzv store listening on HOST:PORT`` once bound. The secret comes
    from ``--auth-token-file`` (surrounding whitespace stripped) or else the
    ``RDZV_AUTH_TOKEN`` environment variable, if set.

    Raises:
        ValueError: Only one of ``--tls-cert`` and ``--tls-key`` was given,
            the token file is empty or a limit is not positive.
        ImportError: ``--loop uvloop`` and uvloop is not installed.
        OSError: A file could not be read or the address could not be bound.
    """
    security = ServerSecurity.from_files(args.auth_token_file, args.tls_cert, args.tls_key)
    server = secured_server(
        args.host,
        args.port,
        security,
        max_connections=args.max_connections,
        max_handshakes=args.max_handshakes,
        handshake_timeout=args.handshake_timeout,
        max_connections_per_address=args.max_connections_per_address,
        frame_timeout=args.frame_timeout,
        idle_timeout=args.idle_timeout,
        loop=args.loop,
    )

    with contextlib.ExitStack() as stack:
        metrics: MetricsServer | None = None
        if args.metrics_port is not None:
            try:
                metrics = MetricsServer(
                    _server_metrics(server), args.metrics_host, args.metrics_port
                )
            except (OSError, OverflowError) as exc:
                where = format_endpoint(args.metrics_host, args.metrics_port)
                raise ValueError(
                    f"--metrics-port: cannot listen on {where}: "
                    f"{getattr(exc, 'strerror', None) or exc}"
                ) from None
            stack.callback(metrics.close)

        def announce(srv: TCPStoreServer) -> None:
            shown = f"[{srv.host}]" if ":" in srv.host else srv.host
            suffix = f" ({', '.join(security.features)})" if security.features else ""
            print(f"rdzv store listening on {shown}:{srv.port}{suffix}", flush=True)
            if metrics is not None:
                where = format_endpoint(metrics.host, metrics.port)
                print(f"rdzv store metrics at http://{where}/metrics", flush=True)

        server.serve(announce)


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        with _warnings_to_stderr("rdzv serve"):
            _serve(args)
    except OSError as exc:
        if exc.filename is not None:
            print(f"rdzv serve: cannot read {exc.filename}: {exc.strerror}", file=sys.stderr)
        else:
            where = format_endpoint(args.host or "0.0.0.0", args.port)  # noqa: S104 - a message
            print(f"rdzv serve: cannot listen on {where}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    except (ValueError, ImportError, ssl.SSLError) as exc:
        print(f"rdzv serve: {exc}", file=sys.stderr)
        return 1
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from rdzv.status_cli import status_command  # noqa: PLC0415 - keep other commands light

    with _warnings_to_stderr("rdzv status"):
        return status_command(args)


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser of the ``rdzv`` command."""
    parser = argparse.ArgumentParser(
        prog="rdzv", description="Elastic rendezvous for distributed jobs."
    )
    parser.add_argument("--version", action="version", version=f"rdzv {rdzv.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    backends = commands.add_parser(
        "backends", help="list the registered rendezvous backends and where each came from"
    )
    backends.set_defaults(func=_cmd_backends, command_parser=backends)
    run = commands.add_parser(
        "run",
        help="start this node's workers of an elastic job (torchrun-compatible options)",
        description="Start this node's workers and keep them in one group with the other "
        "nodes: rdzv run [options] script.py args... | -m module args... Every option of "
        "torchrun is accepted, also from its PET_<OPTION> environment variable.",
    )
    add_run_arguments(run)
    run.set_defaults(func=_cmd_run, command_parser=run)
    status = commands.add_parser(
        "status", help="show a run's round, members with ranks and heartbeat ages, and wait list"
    )
    add_status_arguments(status)
    status.set_defaults(func=_cmd_status, command_parser=status)
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
        "--max-handshakes",
        type=int,
        default=DEFAULT_MAX_HANDSHAKES,
        help="most connections still in their handshake, apart from --max-connections; "
        "a newcomer closes the oldest (default: %(default)s)",
    )
    serve.add_argument(
        "--handshake-timeout",
        type=float,
        default=DEFAULT_HANDSHAKE_TIMEOUT,
        help="seconds a new connection has to finish its handshake (default: %(default)s)",
    )
    serve.add_argument(
        "--max-connections-per-address",
        type=int,
        default=None,
        help="most connections from one address (default: 3/4 of --max-connections "
        "without a secret, none with one)",
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
    serve.add_argument(
        "--loop",
        choices=EVENT_LOOPS,
        default=EVENT_LOOPS[0],
        help="the event loop: the standard library's, or uvloop's, which needs the "
        "rdzv[fast] extra (default: %(default)s)",
    )
    serve.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (0 picks a free port)",
    )
    serve.add_argument(
        "--metrics-host",
        default="0.0.0.0",  # noqa: S104 - scraped from other machines
        metavar="HOST",
        help="the address the metrics endpoint listens on (default: %(default)s)",
    )
    serve.set_defaults(func=_cmd_serve, command_parser=serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``rdzv`` command on ``argv`` (``sys.argv[1:]`` when None); return the exit status."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # The command's own usage, not the top-level one.
        command_parser: argparse.ArgumentParser = getattr(args, "command_parser", parser)
        command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return 2
    status: int = func(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
