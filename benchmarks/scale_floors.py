"""The scale benchmark's floors: rdzv's messages of one round on an engine, with no handler.

A floor column runs in the same agent processes and threads, pinned alike,
against the same servers as the column it is the floor of
(:data:`FLOOR_OF`), and sends what an rdzv member of one round sends and
waits for, each as the cheapest request that does it: read the head (the
round to join), join (one write that returns the node's position), wait for
the seal, then confirm (one write that counts the node in) and wait for the
verdict; the ``-noconfirm`` columns stop at the seal. The node whose
position reaches ``max`` seals at once, the one reaching ``min`` after
sleeping the last call (reading the count then); the last to confirm writes
the verdict. No keep-alive, bootstrap port, state, seats, deadlines or
decisions: whatever time a round takes here is the harness's and the
messages', so rdzv's figures over these are what its handler adds. A floor
emits the handler's ``enqueue``, ``sealed`` and ``complete`` events, so its
phases are cut alike.

* ``floor``: on rdzv's TCP store, through its client (:class:`StoreFloor`).
* ``etcd-floor``, ``redis-floor``: on the engine, through the backend and
  store that rdzv's handler gets there (:class:`EngineFloor`), so each
  message costs what the handler's costs.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from typing import Any

from _common import CountingStore

FLOOR_OF = {
    "floor": "rdzv",
    "floor-noconfirm": "rdzv",
    "etcd-floor": "etcd",
    "etcd-floor-noconfirm": "etcd",
    "redis-floor": "redis",
    "redis-floor-noconfirm": "redis",
}
"""Each floor column and the column it is the floor of."""
FLOOR_SCENARIOS = ("formation", "lastcall")
"""The scenarios the floor columns run: one round of a group that stays whole."""
_TIMEOUT = 120.0
"""Seconds a floor's wait may take (the handlers' read timeout in the benchmark)."""


def engine_of(column: str) -> str:
    """Return the column whose servers ``column`` uses (a floor's column, or itself)."""
    return FLOOR_OF.get(column, column)


def floor_column(column: str) -> str | None:
    """Return the floor (with the confirmation) of ``column``, or None if it has none."""
    return next((f for f, of in FLOOR_OF.items() if of == column), None)


class Floor:
    """One round's messages (see the module); subclasses send them on their engine."""

    def __init__(self, cfg: dict[str, Any], addr: str, confirm: bool) -> None:
        self.node = addr
        self._confirm = confirm
        self._min, self._max, self._last_call = cfg["min"], cfg["max"], cfg["last_call"]
        self._log = logging.getLogger("rdzv.dynamic")

    def _event(self, action: str) -> None:
        self._log.info("floor %s", action, extra={"rdzv_event": {"action": action}})

    def next_rendezvous(self) -> Any:
        self.head()
        position = self.join()
        self._event("enqueue")
        if position in (self._min, self._max):
            if position != self._max:
                time.sleep(self._last_call)
            self.seal(self.joined())
            self._event("sealed")
        world = self.await_seal()
        if position > world:
            raise RuntimeError(f"{self.node} joined at {position}, after a seal of {world}")
        if self._confirm:
            if self.confirm() == world:
                self.set_verdict()
            self.await_verdict()
        self._event("complete")
        return argparse.Namespace(rank=position - 1, world_size=world)

    def head(self) -> None:
        """Read the head (the round to join)."""
        raise NotImplementedError

    def join(self) -> int:
        """Join the round; return this node's 1-based position."""
        raise NotImplementedError

    def joined(self) -> int:
        """Return how many nodes joined."""
        raise NotImplementedError

    def seal(self, world: int) -> None:
        """Seal the round at ``world`` members."""
        raise NotImplementedError

    def await_seal(self) -> int:
        """Wait for the seal; return its world size."""
        raise NotImplementedError

    def confirm(self) -> int:
        """Count this node in; return how many confirmed."""
        raise NotImplementedError

    def set_verdict(self) -> None:
        """Write the verdict (every member confirmed)."""
        raise NotImplementedError

    def await_verdict(self) -> None:
        """Wait for the verdict."""
        raise NotImplementedError


class StoreFloor(Floor):
    """The floor on rdzv's TCP store: ``append`` and ``add`` to join and confirm, blocking ``get`` to wait."""

    def __init__(
        self,
        cfg: dict[str, Any],
        addr: str,
        count: Callable[[str, tuple[Any, ...], Any], None],
        confirm: bool,
    ) -> None:
        from rdzv.store.tcp import TCPStore

        super().__init__(cfg, addr, confirm)
        self._store: Any = CountingStore(
            TCPStore("127.0.0.1", cfg["port"], timeout=_TIMEOUT), count
        )
        self._key = f"floor/{cfg['run_id']}/"

    def head(self) -> None:
        self._store.compare_set(f"{self._key}head", b"probe", b"probe")

    def join(self) -> int:
        self._store.append(f"{self._key}queue", self.node.encode())
        return int(self._store.add(f"{self._key}joined", 1))

    def joined(self) -> int:
        return int(self._store.add(f"{self._key}joined", 0))

    def seal(self, world: int) -> None:
        self._store.set(f"{self._key}seal", str(world).encode())

    def await_seal(self) -> int:
        return int(self._store.get(f"{self._key}seal"))

    def confirm(self) -> int:
        self._store.append(f"{self._key}confirmed", self.node.encode())
        return int(self._store.add(f"{self._key}confirmations", 1))

    def set_verdict(self) -> None:
        self._store.set(f"{self._key}verdict", b"1")

    def await_verdict(self) -> None:
        self._store.get(f"{self._key}verdict")


class EngineFloor(Floor):
    """The floor on etcd or Redis, through the backend and store rdzv's handler gets there.

    The head is ``get_state``, a join and a confirmation are ``enqueue`` on
    the join and the confirmation queue, the seal is a ``set_state`` (of the
    world size: no participant list) that ``wait_for_state`` waits for, and
    the verdict is the backend's (``set_verdict``, and one
    ``wait_for_verdict`` from the seal's token), as rdzv's handler keeps it
    on both engines.
    """

    def __init__(self, cfg: dict[str, Any], addr: str, engine: str, confirm: bool) -> None:
        import rdzv
        from rdzv.registry import open_backend

        super().__init__(cfg, addr, confirm)
        params = rdzv.RendezvousParameters(
            engine,
            cfg["endpoint"],
            cfg["run_id"],
            cfg["min"],
            cfg["max"],
            local_addr=addr,
            read_timeout=_TIMEOUT,
            # The same etcd client as the column it is the floor of.
            **({"client": cfg["etcd_client"]} if engine == "etcd" and "etcd_client" in cfg else {}),
        )
        self._backend: Any
        self._backend, self._store = open_backend(params)
        self._confirms = self._backend.confirmation_queue()
        self._sealed_at: Any = None

    def head(self) -> None:
        self._backend.get_state()

    def join(self) -> int:
        return int(self._backend.enqueue(0, self.node.encode()))

    def joined(self) -> int:
        return int(self._backend.queue_length(0))

    def seal(self, world: int) -> None:
        self._backend.set_state(str(world).encode(), None)

    def await_seal(self) -> int:
        deadline = time.monotonic() + _TIMEOUT
        while (found := self._backend.wait_for_state(None, _TIMEOUT)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no seal within {_TIMEOUT:g} s")
        self._sealed_at = found[1]
        return int(found[0])

    def confirm(self) -> int:
        return int(self._confirms.enqueue(0, self.node.encode()))

    def set_verdict(self) -> None:
        self._backend.set_verdict(0)

    def await_verdict(self) -> None:
        if self._backend.wait_for_verdict(0, self._sealed_at, _TIMEOUT) is not True:
            raise TimeoutError(f"no verdict within {_TIMEOUT:g} s")


def make_floor(
    column: str, cfg: dict[str, Any], addr: str, count: Callable[[str, tuple[Any, ...], Any], None]
) -> Floor | None:
    """Return one agent of the floor ``column`` (its TCP store calls told to ``count``), or None."""
    engine = FLOOR_OF.get(column)
    if engine is None:
        return None
    confirm = not column.endswith("-noconfirm")
    if engine == "rdzv":
        return StoreFloor(cfg, addr, count, confirm)
    return EngineFloor(cfg, addr, engine, confirm)
