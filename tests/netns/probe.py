"""Run inside a test-bed host: serve TCP, or try TCP connects and print the outcomes.

``probe.py serve PORT`` accepts (and closes) connections on every IPv4 and
IPv6 address until killed; ``probe.py connect TIMEOUT HOST:PORT...`` prints
one JSON object mapping each target to whether a connection was made
(:func:`attempt_all`, also called in-process through ``Host.call``).
"""

from __future__ import annotations

import json
import socket
import sys
from concurrent.futures import ThreadPoolExecutor


def serve(port: int) -> None:
    server = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        conn.close()


def split(target: str) -> tuple[str, int]:
    host, _, port = target.rpartition(":")
    return host.strip("[]"), int(port)


def attempt(target: str, timeout: float) -> bool:
    try:
        with socket.create_connection(split(target), timeout=timeout):
            return True
    except OSError:
        return False


def attempt_all(targets: list[str], timeout: float) -> dict[str, bool]:
    """Try every target at once (threads started here share the caller's namespace)."""
    with ThreadPoolExecutor(len(targets)) as pool:
        outcomes = list(pool.map(lambda t: attempt(t, timeout), targets))
    return dict(zip(targets, outcomes, strict=True))


def connect(timeout: float, targets: list[str]) -> None:
    print(json.dumps(attempt_all(targets, timeout)))


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(int(sys.argv[2]))
    else:
        connect(float(sys.argv[2]), sys.argv[3:])
