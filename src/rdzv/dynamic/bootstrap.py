"""The bootstrap address: the port a joining node holds, and the wait for rank 0's address.

Theory of operation
-------------------
Every joining node binds a free port and holds it (bound, not listening,
so no other process takes it) and names it in its join record; the sealer
copies rank 0's port into the sealed state, so no member waits for rank 0
after the seal. Each node lets its port go when it completes (rank 0's
workers then serve on it) or fails (:class:`HeldPort`).

A state sealed without a port (by an older rdzv, or with a rank 0 that
found no free port to hold) falls back to waiting: a member of rank > 0
waits for rank 0 to publish the keys in short slices, checking between
them that rank 0 is still a live member of the round
(:func:`await_bootstrap`).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from datetime import timedelta

from rdzv.api import RendezvousStoreInfo
from rdzv.dynamic.machine import bootstrap_abandoned
from rdzv.dynamic.shared import SharedState
from rdzv.dynamic.state import RendezvousState
from rdzv.errors import RendezvousTimeoutError
from rdzv.retry import Clock
from rdzv.store.base import Store

__all__ = ["BOOTSTRAP_CHECK", "HeldPort", "await_bootstrap", "bound_socket"]

BOOTSTRAP_CHECK = 0.5
"""Seconds between checks that rank 0 is still a member while waiting for its address."""


def bound_socket() -> socket.socket:
    """Return a TCP socket bound to a free port on every interface (not listening)."""
    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        held.bind(("", 0))
    except OSError:
        held.close()
        raise
    return held


class HeldPort:
    """The port one node holds for the bootstrap store while it joins.

    Args:
        failed: Called with the error when no port could be bound.
    """

    def __init__(self, failed: Callable[[OSError], None]) -> None:
        self._failed = failed
        self._held: socket.socket | None = None

    def hold(self) -> int:
        """Bind a free port (once per join) and return it; 0 when none is free.

        A host that has no free port (every ephemeral port taken) joins
        without one: if it becomes rank 0, the seal names no port and rank
        0 publishes one after the seal, as an older rdzv's rank 0 does,
        instead of this node failing its join and leaving the others to
        wait for it until their join timeout.
        """
        if self._held is None:
            try:
                self._held = bound_socket()
            except OSError as exc:
                self._failed(exc)
                return 0
        return int(self._held.getsockname()[1])

    def release(self) -> None:
        """Let the held port go, so rank 0's workers can serve on it."""
        held, self._held = self._held, None
        if held is not None:
            held.close()


def await_bootstrap(
    store: Store,
    shared: SharedState,
    state: RendezvousState,
    rank: int,
    clock: Clock,
    join_deadline: float,
) -> bool:
    """Wait for rank 0 of ``state`` to publish its address in ``store``.

    Args:
        store: The round's store.
        shared: The shared state, read between slices.
        state: The sealed round, as read whole.
        rank: This member's rank (> 0).
        clock: The clock of the deadlines.
        join_deadline: The join's deadline on ``clock``.

    Returns:
        True once published; False once rank 0 is no live member.

    Raises:
        RendezvousTimeoutError: Rank 0 stayed a member but did not publish
            within the store timeout, or by the join deadline when that
            comes sooner.
    """
    started = clock()
    timeout = store.timeout.total_seconds()
    deadline, bound = started + timeout, f"within {timeout:g} s"
    if join_deadline < deadline:
        deadline = join_deadline
        bound = f"by the join deadline ({max(0.0, deadline - started):.3g} s of waiting)"
    keys = [RendezvousStoreInfo.MASTER_ADDR_KEY, RendezvousStoreInfo.MASTER_PORT_KEY]
    while True:
        remaining = deadline - clock()
        if remaining <= 0:
            raise RendezvousTimeoutError(
                f"rank {rank} did not see rank 0 publish MASTER_ADDR/MASTER_PORT {bound}"
            )
        slice_ = min(remaining, BOOTSTRAP_CHECK)
        try:
            with clock.blocking(slice_):
                store.wait(keys, timedelta(seconds=slice_))
        except RendezvousTimeoutError:
            current, _ = shared.read()
            if bootstrap_abandoned(state, current):
                return False
        else:
            return True
