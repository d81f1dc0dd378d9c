"""In-process stand-ins for a rendezvous handler and the bootstrap store server."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

from rdzv import (
    HashStore,
    PrefixStore,
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousTimeoutError,
)
from rdzv.launch.bootstrap import BootstrapSpec


class FakeServer:
    """A listening socket on a free loopback port, standing in for a store server."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen()
        self.port = int(self._sock.getsockname()[1])
        self.closed = False

    def close(self) -> None:
        self.closed = True
        self._sock.close()


class ServerFactory:
    """Records every server it starts, and what each was asked to serve."""

    def __init__(self) -> None:
        self.servers: list[FakeServer] = []
        self.specs: list[BootstrapSpec] = []

    def __call__(self, spec: BootstrapSpec) -> FakeServer:
        server = FakeServer()
        self.servers.append(server)
        self.specs.append(spec)
        return server


class FakeGroup:
    """The shared side of an in-process rendezvous of ``world_size`` nodes.

    Every round is a thread barrier; each round gets a fresh prefix of one
    HashStore. ``waiting`` is what ``num_nodes_waiting`` answers;
    ``participants`` is what the rounds' infos list (none by default).
    """

    def __init__(self, world_size: int = 1, run_id: str = "fake-run") -> None:
        self.world_size = world_size
        self.run_id = run_id
        self.store = HashStore(timeout=20)
        self.closed = False
        self.waiting = 0
        self.participants: list[str] = []
        self._lock = threading.Lock()
        self._barrier = threading.Barrier(world_size, timeout=20)
        self.rounds = 0

    def handler(self, rank: int) -> FakeHandler:
        return FakeHandler(self, rank)


class FakeHandler(RendezvousHandler):
    def __init__(self, group: FakeGroup, rank: int) -> None:
        self.group = group
        self.rank = rank
        self.round = 0
        self.joins = 0
        self.shutdowns = 0
        self.closes = 0
        self.before_join: Callable[[FakeHandler], None] | None = None
        self.graceful_exit = False

    def get_backend(self) -> str:
        return "fake"

    def next_rendezvous(self) -> RendezvousInfo:
        if self.before_join is not None:
            self.before_join(self)
        if self.graceful_exit:
            raise RendezvousGracefulExitError("the group is full")
        if self.group.closed:
            raise RendezvousClosedError("closed")
        self.joins += 1
        try:
            index = self.group._barrier.wait()
        except threading.BrokenBarrierError:
            raise RendezvousTimeoutError("not every fake node arrived") from None
        if index == 0:
            with self.group._lock:
                self.group.rounds += 1
                self.group.waiting = 0
        self.group._barrier.wait()
        store = PrefixStore(f"round/{self.round}", self.group.store)
        self.round += 1
        return RendezvousInfo(
            store, self.rank, self.group.world_size, participants=self.group.participants
        )

    def is_closed(self) -> bool:
        return self.group.closed

    def set_closed(self) -> None:
        self.closes += 1
        self.group.closed = True

    def num_nodes_waiting(self) -> int:
        return self.group.waiting

    def get_run_id(self) -> str:
        return self.group.run_id

    def shutdown(self) -> bool:
        self.shutdowns += 1
        return True
