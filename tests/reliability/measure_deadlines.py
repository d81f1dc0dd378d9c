"""Measure how long handler calls take when etcd, Redis or the TCP store stops answering.

    PYTHONPATH=src python -m tests.reliability.measure_deadlines etcd redis c10d

Prints one line per case: a free loopback port ("unreachable"; not for
``c10d``, whose client connects when it is built), then a private server
paused with SIGSTOP ("paused"); the handlers are the ones
``test_backend_deadlines.py`` builds (join 3 s, close 2 s, keep-alive
0.5 s x 3; the TCP store's timeout 30 s). The figures in
docs/reliability.md come from this script.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from tests.procs import free_port
from tests.reliability.test_backend_deadlines import _handler, _paused, _server, _timed

_KEEPALIVE_CAP = 200.0
"""Seconds to wait at most for the keep-alive to give up."""


def _report(kind: str, what: str, call: Callable[[], Any]) -> None:
    took, error = _timed(call)
    outcome = "ok" if error is None else type(error).__name__
    print(f"{kind:5} {what:45} {took:6.2f} s  {outcome}", flush=True)


def measure(kind: str) -> None:
    """Print the figures of one backend kind (``etcd``, ``redis`` or ``c10d``)."""
    if kind != "c10d":
        handler = _handler(kind, f"127.0.0.1:{free_port()}")
        try:
            _report(kind, "unreachable: next_rendezvous (join 3 s)", handler.next_rendezvous)
            _report(kind, "unreachable: is_closed", handler.is_closed)
            _report(kind, "unreachable: shutdown", handler.shutdown)
        finally:
            handler.close()
    with _server(kind) as (endpoint, proc):
        handler = _handler(kind, endpoint)
        try:
            handler.next_rendezvous()
            with _paused(proc):
                started = time.monotonic()
                while (
                    handler.statistics().keepalive_error is None
                    and time.monotonic() - started < _KEEPALIVE_CAP
                ):
                    time.sleep(0.05)
                took = time.monotonic() - started
                print(f"{kind:5} {'paused: keep-alive gives up':45} {took:6.2f} s", flush=True)
                _report(kind, "paused: next_rendezvous (join 3 s)", handler.next_rendezvous)
                _report(kind, "paused: set_closed (close 2 s)", handler.set_closed)
                _report(kind, "paused: shutdown", handler.shutdown)
        finally:
            handler.close()


if __name__ == "__main__":
    for name in sys.argv[1:] or ["etcd", "redis"]:
        measure(name)
