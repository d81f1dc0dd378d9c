"""Helpers of the store tests: servers in subprocesses, a torch client adapter."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from rdzv.errors import StoreTimeoutError
from rdzv.store.base import Store, Timeout, Value, to_bytes, to_seconds
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


def _translate(exc: Exception) -> Exception:
    import torch.distributed as dist

    if isinstance(exc, dist.QueueEmptyError) or "timeout" in str(exc).lower():
        return StoreTimeoutError(str(exc))
    return exc


CONNECT_TIMEOUT = 30.0
"""Seconds a torch client may take to connect (its calls keep the timeout they are given)."""


class TorchClientStore(Store):
    """A stock ``torch.distributed.TCPStore`` client behind rdzv's Store API (tests only)."""

    def __init__(self, port: int, timeout: Timeout = 5.0) -> None:
        import torch.distributed as dist

        super().__init__(timeout)
        # torch's client uses one timeout for connecting and for every call;
        # a loaded machine can delay the connection past an operation's bound.
        self._store: Any = dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=CONNECT_TIMEOUT)
        )
        self._store.set_timeout(timedelta(seconds=to_seconds(timeout)))

    def set_timeout(self, timeout: Timeout) -> None:
        super().set_timeout(timeout)
        self._store.set_timeout(timedelta(seconds=to_seconds(timeout)))

    def _run(self, name: str, *args: Any) -> Any:
        try:
            return getattr(self._store, name)(*args)
        except Exception as exc:
            translated = _translate(exc)
            if translated is exc:
                raise
            raise translated from exc

    def set(self, key: str, value: Value) -> None:
        self._run("set", key, to_bytes(value))

    def get(self, key: str) -> bytes:
        return bytes(self._run("get", key))

    def add(self, key: str, amount: int) -> int:
        return int(self._run("add", key, amount))

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        return bytes(self._run("compare_set", key, to_bytes(expected), to_bytes(desired)))

    def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None:
        if timeout is None:
            self._run("wait", list(keys))
        else:
            self._run("wait", list(keys), timedelta(seconds=to_seconds(timeout)))

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self._run("check", list(keys)))

    def delete_key(self, key: str) -> bool:
        return bool(self._run("delete_key", key))

    def num_keys(self) -> int:
        return int(self._run("num_keys"))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return [bytes(v) for v in self._run("multi_get", list(keys))]

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        if len(keys) != len(values):
            raise ValueError("keys and values differ in length")
        self._run("multi_set", list(keys), [to_bytes(v) for v in values])

    def append(self, key: str, value: Value) -> None:
        self._run("append", key, to_bytes(value))

    def list_keys(self) -> list[str]:
        return list(self._run("list_keys"))

    def queue_push(self, key: str, value: Value) -> None:
        self._run("queue_push", key, to_bytes(value))

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        return bytes(self._run("queue_pop", key, block))

    def queue_len(self, key: str) -> int:
        return int(self._run("queue_len", key))
