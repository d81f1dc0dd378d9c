"""Fixtures for multi-process tests: a store host and agent subprocesses, all on loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.procs import subprocess_env


class Agent:
    """One ``tests.nodes.agent dynamic`` subprocess; a reader thread collects its JSON lines."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.nodes.agent", "dynamic", "--events", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=subprocess_env(),
            text=True,
        )
        self.lines: list[dict[str, Any]] = []
        self.stderr = ""
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                item = json.loads(line)
            except ValueError:
                item = {"event": "garbage", "line": line}
            with self._cond:
                self.lines.append(item)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for(
        self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 30
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for item in self.lines:
                    if predicate(item):
                        return item
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(
                        f"agent {self.proc.pid}: condition not met; saw {self.lines}; stderr {self._stderr()}"
                    )
                self._cond.wait(min(remaining, 0.2))

    def go(self) -> None:
        self.wait_for(lambda i: i["event"] == "ready")
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def rounds(self) -> list[dict[str, Any]]:
        with self._cond:
            return [i for i in self.lines if i["event"] == "round"]

    def finish(self, timeout: float = 30) -> dict[str, Any]:
        exit_line = self.wait_for(lambda i: i["event"] == "exit", timeout)
        self.proc.wait(timeout=timeout)
        return exit_line

    def _stderr(self) -> str:
        if self.proc.poll() is None or self.proc.stderr is None:
            return "(running)"
        if not self.stderr:
            self.stderr = self.proc.stderr.read()[-2000:]
        return self.stderr

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        self.kill()
        self._reader.join(timeout=10)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def agents() -> Iterator[Callable[..., Agent]]:
    started: list[Agent] = []

    def start(*args: str) -> Agent:
        agent = Agent(list(args))
        started.append(agent)
        return agent

    try:
        yield start
    finally:
        for agent in started:
            agent.stop()
        # Shown only when the test fails: every agent's events, not just
        # those of the one whose wait ran out.
        for agent in started:
            print(f"agent {agent.proc.pid}: {agent.lines}")


@pytest.fixture
def store_endpoint() -> Iterator[str]:
    from rdzv.store.tcp import TCPStore

    host = TCPStore("127.0.0.1", 0, is_master=True, timeout=10)
    try:
        yield f"127.0.0.1:{host.port}"
    finally:
        host.close()
