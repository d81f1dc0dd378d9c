"""Admission and shedding: which connections a store server holds, and which it closes.

Two tiers of connections. A connection is in its handshake (TLS,
``VALIDATE``, authentication) until it finishes it; those are capped by
``max_handshakes``, where a newcomer closes the oldest (a real client
finishes in milliseconds, a stalling one is what gets reclaimed). A
handshake younger than :func:`handshake_grace` is never reclaimed: the
newcomer is refused instead and retries (the client backs off), so that
thousands of real clients connecting at once (every agent of a large job
starting) do not close each other's handshakes faster than any can finish.
Only a finished handshake takes one of the ``max_connections`` slots, so
peers without the secret never hold one. Without a secret anyone finishes
the handshake with ``VALIDATE``, so one peer address may hold at most
``max_connections_per_address`` slots.

Both caps are lowered at start to what the open-file limit leaves room for
(with :data:`FD_HEADROOM` spare), so a refusal is a clean accept and close,
not an ``EMFILE``.

When every connection slot is taken, a newcomer is not refused while some
connection has sent nothing since its handshake for longer than the grace
(an idle ``VALIDATE``, what a peer holding slots sends, where a real client
asks for something at once): once the newcomer's handshake is done, the
oldest such connection is closed to give it the slot (``unused_shed``,
logged once). So idle connections that are never used cannot keep a client
out however many of them there are; a client that has sent a request is
never closed for this.

Received bytes not executed yet (mostly incomplete requests) are counted
over all connections, the keys already decoded from an incomplete request
at their memory cost (:data:`~rdzv.store.protocol.DECODED_ITEM_OVERHEAD`
more each); past ``max_buffered_bytes`` the connection whose incomplete
request started first is closed, and so on until under.
"""

from __future__ import annotations

import os
import resource
import time
from typing import Final

from rdzv.store._connection import Connection
from rdzv.store.throttle import ThrottledLog

__all__ = ["FD_HEADROOM", "HANDSHAKE_GRACE", "Admission", "handshake_grace", "open_descriptors"]

HANDSHAKE_GRACE: Final = 1.0
"""Seconds a handshake in progress is safe from a newcomer (see :func:`handshake_grace`)."""
FD_HEADROOM: Final = 64
"""File descriptors kept free of connections, for the process's other needs."""


def handshake_grace(handshake_timeout: float) -> float:
    """Return how long a handshake in progress is safe from being reclaimed by a newcomer.

    :data:`HANDSHAKE_GRACE`, or a quarter of the handshake deadline when
    that is shorter: a stalling peer is still reclaimed well before it
    would expire (all in seconds).
    """
    return min(HANDSHAKE_GRACE, handshake_timeout / 4)


class Admission:
    """The connection slots of a store server, and the shedding that keeps it in its limits.

    The :class:`~rdzv.store._connection.Slots` of a server's connections; a
    :class:`~rdzv.store.server.TCPStoreServer` is one (its constructor
    documents the limits). Every method runs on the server loop's thread.
    """

    def __init__(
        self,
        max_connections: int,
        max_handshakes: int,
        max_connections_per_address: int | None,
        max_buffered_bytes: int,
        handshake_timeout: float,
        has_secret: bool,
        throttled: ThrottledLog,
    ) -> None:
        self.max_connections = max_connections
        self.max_handshakes = max_handshakes
        self.max_connections_per_address = max_connections_per_address
        self.max_buffered_bytes = max_buffered_bytes
        self.buffered = 0
        """Bytes of received requests not executed yet, over every connection."""
        self.connection_cap = max_connections
        """The connection cap in force: ``max_connections``, or less when the
        open-file limit does not allow it (set when the server starts)."""
        self.handshake_cap = max_handshakes
        """The cap on connections in their handshake in force (likewise)."""
        self.handshake_grace = handshake_grace(handshake_timeout)
        """Seconds a handshake in progress is safe from a newcomer."""
        self._has_secret = has_secret
        self.address_cap = self._address_cap(max_connections)
        """The per-address cap in force, or None."""
        self.refused_connections = 0
        """Connections closed at once because a connection cap was reached."""
        self.reclaimed_connections = 0
        """Connections in their handshake closed to make room for a newer one."""
        self.shed_connections = 0
        """Connections closed because incomplete requests passed ``max_buffered_bytes``."""
        self.accepted_connections = 0
        """Connections given a slot (not refused) since the server started."""
        self.unused_shed = 0
        """Connections closed, unused since their handshake, to give a newcomer their slot."""
        self.connections: set[Connection] = set()
        """Connections past the handshake."""
        self._unused: dict[Connection, None] = {}
        """Connections past the handshake, oldest first, that had sent no request
        since when they were put here (those that since have are dropped lazily)."""
        self.handshaking: dict[Connection, None] = {}
        """Connections in their handshake, oldest first."""
        self._per_address: dict[str, int] = {}
        self.throttled = throttled
        """The server's warnings, the kinds a flood can repeat throttled."""

    def _address_cap(self, cap: int) -> int | None:
        if self.max_connections_per_address is not None:
            return self.max_connections_per_address
        if self._has_secret:
            return None
        return max(1, cap - cap // 4)

    def _refusal(self, address: str) -> str | None:
        """Return why a connection from ``address`` cannot have a slot, or None."""
        if len(self.connections) >= self.connection_cap:
            return (
                f"the server already has {len(self.connections)} connections "
                f"(max_connections={self.connection_cap})"
            )
        return self._address_refusal(address)

    def _address_refusal(self, address: str) -> str | None:
        """Return why ``address`` may have no more connections, or None."""
        cap = self.address_cap
        if cap is not None and self._per_address.get(address, 0) >= cap:
            return f"{address} already has {cap} connections (max_connections_per_address={cap})"
        return None

    def _refuse(self, peer: str, why: str) -> None:
        self.refused_connections += 1
        self.throttled.warning("refused", "store client %s refused: %s", peer, why)

    def make_room(self, address: str, peer: str, now: float) -> bool:
        """Decide whether a connection just accepted from ``address`` may start its handshake.

        Closes the oldest handshakes past the grace to free a slot (see the
        module). A connection that may not was counted and logged, and must be closed.
        """
        why = self._refusal(address)
        if why is not None and self._unused_connection(now) is not None:
            why = self._address_refusal(address)  # a slot is freed once its handshake is done
        while why is None and len(self.handshaking) >= self.handshake_cap:
            oldest = next(iter(self.handshaking))
            if now - oldest.opened_at < self.handshake_grace:
                why = (
                    f"all {self.handshake_cap} handshake slots (max_handshakes) hold handshakes "
                    f"started less than {self.handshake_grace:g} s ago; it may retry"
                )
                break
            self.release(oldest)
            oldest.abort()
            self.reclaimed_connections += 1
            self.throttled.warning(
                "reclaimed",
                "store client %s disconnected: its handshake was the oldest unfinished one "
                "when %s connected and all %d handshake slots were taken (max_handshakes)",
                oldest.peer,
                peer,
                self.handshake_cap,
            )
        if why is not None:
            self._refuse(peer, why)
            return False
        return True

    def admit(self, conn: Connection) -> bool:
        """Move ``conn``, whose handshake is done, into a connection slot; return whether it has one.

        One without a slot was counted and logged, and must be closed.
        """
        if conn.is_open:
            return True
        self.handshaking.pop(conn, None)
        now = time.monotonic()
        why = self._refusal(conn.address)
        if why is not None and self._shed_unused(conn.peer, now):
            why = self._refusal(conn.address)
        if why is not None:
            self._refuse(conn.peer, why)
            return False
        conn.is_open = True
        conn.admitted_at = now
        self.connections.add(conn)
        self._unused[conn] = None
        self.accepted_connections += 1
        self._per_address[conn.address] = self._per_address.get(conn.address, 0) + 1
        return True

    def release(self, conn: Connection) -> None:
        """Give back the slot of a connection that ended (idempotent)."""
        if conn.released:
            return
        conn.released = True
        self.buffered -= conn.buffered
        conn.buffered = 0
        self.handshaking.pop(conn, None)
        if conn.is_open:
            self.connections.discard(conn)
            self._unused.pop(conn, None)
            left = self._per_address[conn.address] - 1
            if left:
                self._per_address[conn.address] = left
            else:
                del self._per_address[conn.address]

    def _unused_connection(self, now: float) -> Connection | None:
        """Return the oldest connection unused since its handshake, if older than the grace."""
        unused = self._unused
        while unused:
            conn = next(iter(unused))
            if conn.used:
                del unused[conn]
                continue
            return conn if now - conn.admitted_at >= self.handshake_grace else None
        return None

    def _shed_unused(self, peer: str, now: float) -> bool:
        """Close the connection :meth:`_unused_connection` finds, for ``peer``; return whether."""
        oldest = self._unused_connection(now)
        if oldest is None:
            return False
        self.release(oldest)
        oldest.abort()
        if not self.unused_shed:
            self.throttled.warning(
                None,
                "store client %s disconnected to give %s its slot: every connection slot "
                "(max_connections=%d) was taken, and it had sent nothing since its handshake "
                "%.1f s before; this is logged once, later ones are counted (unused_shed)",
                oldest.peer,
                peer,
                self.connection_cap,
                now - oldest.admitted_at,
            )
        self.unused_shed += 1
        return True

    def account(self, conn: Connection) -> None:
        """Count what ``conn`` buffers now; shed the oldest partial requests past the total."""
        if conn.released:
            return
        held = conn.parser.held + len(conn.inbox)
        if held != conn.buffered:
            self.buffered += held - conn.buffered
            conn.buffered = held
            if self.buffered > self.max_buffered_bytes:
                self._shed()

    def _shed(self) -> None:
        """Close the connections whose incomplete requests started first until under the total.

        A connection that stopped for its turn or its unread replies is
        waiting for the server, and is spared, unless what it waits with is
        received bytes not parsed yet (its inbox): that is a request still
        arriving, faster than a turn parses it.
        """
        while self.buffered > self.max_buffered_bytes:
            started = [
                conn
                for conn in [*self.handshaking, *self.connections]
                if conn.buffered
                and conn.frame_started is not None
                and (not conn.stalled or conn.inbox)
            ]
            if not started:
                return
            oldest = min(started, key=lambda conn: conn.frame_started or 0.0)
            held = oldest.buffered
            self.release(oldest)
            oldest.abort()
            self.shed_connections += 1
            self.throttled.warning(
                "shed",
                "store client %s disconnected: the server held more than %d bytes of "
                "incomplete requests (max_buffered_bytes), and its %d bytes had been "
                "arriving the longest",
                oldest.peer,
                self.max_buffered_bytes,
                held,
            )

    def fit_descriptor_limit(self) -> None:
        """Lower the caps to what the open-file limit leaves room for."""
        room = _descriptor_room()
        wanted = self.max_connections + self.max_handshakes
        if room is None or wanted <= room:
            return
        self.handshake_cap = max(1, min(self.max_handshakes, room // 8))
        self.connection_cap = max(1, min(self.max_connections, room - self.handshake_cap))
        self.address_cap = self._address_cap(self.connection_cap)
        self.throttled.warning(
            None,
            "store server: max_connections=%d lowered to %d and max_handshakes=%d to %d: "
            "the open-file limit (RLIMIT_NOFILE) leaves room for %d sockets; raise it "
            "(ulimit -n) to serve more clients",
            self.max_connections,
            self.connection_cap,
            self.max_handshakes,
            self.handshake_cap,
            room,
        )


def _descriptor_room() -> int | None:
    """Return how many more sockets the open-file limit allows, keeping headroom.

    The soft ``RLIMIT_NOFILE`` minus the descriptors open now and
    :data:`FD_HEADROOM`; None when there is no limit.
    """
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    return max(2, soft - open_descriptors() - FD_HEADROOM)


def open_descriptors() -> int:
    """Return how many file descriptors this process has open (0 when it cannot tell)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0
