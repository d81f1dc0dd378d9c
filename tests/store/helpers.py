"""Helpers of the store tests: servers in subprocesses, a torch client."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

from rdzv.store.base import Store, Timeout
from rdzv.store.foreign import as_store
from tests.engines.servers import stop_process
from tests.procs import subprocess_env


@contextmanager
def serve_process(
    *extra: str, host: str = "127.0.0.1", env: dict[str, str] | None = None, announces: str = ""
) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """Run ``rdzv serve`` in a subprocess on a free port; yield it and its port.

    ``announces`` must appear in its ``listening`` line (``(auth`` ...).
    """
    proc = subprocess.Popen(
        [sys.executable, "-m", "rdzv.cli", "serve", "--host", host, "--port", "0", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env or subprocess_env(),
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("rdzv store listening on "), (
            line,
            proc.stderr.read() if proc.stderr else "",
        )
        assert announces in line, line
        port = int(line.split()[4].rsplit(":", 1)[1])
        yield proc, port
    finally:
        stop_process(proc, grace=10.0)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


CONNECT_TIMEOUT = 30.0
"""Seconds a torch client may take to connect (its calls keep the timeout they are given)."""


def torch_client(port: int, timeout: Timeout = 5.0) -> Store:
    """A stock ``torch.distributed.TCPStore`` client of ``port``, as rdzv takes any torch store."""
    import torch.distributed as dist

    # torch's client uses one timeout for connecting and for every call;
    # a loaded machine can delay the connection past an operation's bound.
    store = as_store(
        dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=CONNECT_TIMEOUT)
        )
    )
    store.set_timeout(timeout)
    return store
