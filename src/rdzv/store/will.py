"""A will kept on a dedicated connection: a key the server sets when this process dies.

Theory of operation
-------------------
rdzv's server keeps one *will* per connection (``WILL``: a key and a value)
and writes it when the connection closes. A process that is killed has its
sockets closed by the kernel, so the server writes the will within a round
trip of the death: this is how the store backend learns in milliseconds
that a node's agent was SIGKILLed, where heartbeats take the dead-node
timeout.

:class:`Will` opens its own client (:meth:`TCPStore.clone
<rdzv.store.tcp.TCPStore.clone>`), registers the will, and parks one thread
in :meth:`~rdzv.store.tcp.TCPStore.wait_closed` on that idle connection,
which sends nothing more. Should the server end the connection while this
process lives (the server restarted, a middlebox reset it), the will was
written although nobody died: the thread connects again at once, registers
the will again, and calls ``on_restored`` (the liveness backend beats, so
the mark the will wrote is replaced; observers give a will's mark a short
grace for exactly this). Reconnecting backs off (jittered, capped) while the
server is unreachable. :meth:`Will.stop` wakes the thread through a pipe; it
withdraws the will before closing, so a clean stop writes nothing.

The thread is supervised: any error in one pass is logged and retried
after the back-off; only :meth:`Will.stop` ends it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Protocol

from rdzv.retry import jitter
from rdzv.store.base import Value
from rdzv.threads import start_thread

__all__ = ["Will", "WillClient"]

_log = logging.getLogger(__name__)


class WillClient(Protocol):
    """The calls a will makes on its client (:class:`rdzv.store.tcp.TCPStore` has them)."""

    def set_will(self, key: str, value: Value | None) -> None:
        """Register the will on this connection, or withdraw it (None)."""

    def wait_closed(self, wake: int, timeout: float) -> bool:
        """Block until the connection is gone (True), ``wake`` is readable or timeout."""

    def close(self) -> None:
        """Close the connection."""


_BACKOFF_FIRST = 0.05
_BACKOFF_MAX = 2.0
_HOLD_SLICE = 60.0
"""Seconds one ``wait_closed`` blocks before looking at the stop flag again
(the pipe wakes it at once; this only bounds a missed wake)."""
_STOP_WAIT = 2.0
"""Seconds :meth:`Will.stop` waits for the thread to withdraw the will."""


class Will:
    """Hold ``key = value`` as the will of a connection of its own to ``store``'s server.

    Args:
        connect: Makes a new client of an rdzv server, with its own
            connection (:meth:`TCPStore.clone <rdzv.store.tcp.TCPStore.clone>`).
        key: The key the server sets when the connection closes.
        value: What it sets.
        on_restored: Called after the will was registered again on a new
            connection, the old one having closed while this process lived.
    """

    def __init__(
        self,
        connect: Callable[[], WillClient],
        key: str,
        value: Value,
        on_restored: Callable[[], None],
    ) -> None:
        self._connect = connect
        self._key = key
        self._value = value
        self._on_restored = on_restored
        self._stopped = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self._thread = start_thread(self._run, name=f"rdzv-will-{key}")

    def stop(self) -> None:
        """Withdraw the will and close its connection (idempotent; bounded by a short wait)."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        os.write(self._wake_w, b"x")
        self._thread.join(_STOP_WAIT)
        if not self._thread.is_alive():
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _run(self) -> None:
        client: WillClient | None = None
        backoff = _BACKOFF_FIRST
        lost = False
        try:
            while not self._stopped.is_set():
                try:
                    if client is None:
                        client = self._connect()
                    client.set_will(self._key, self._value)
                    if lost:
                        self._on_restored()
                        lost = False
                    backoff = _BACKOFF_FIRST
                    while not self._stopped.is_set():
                        if client.wait_closed(self._wake_r, _HOLD_SLICE):
                            lost = True
                            break
                except Exception as exc:  # noqa: BLE001 - supervised: retried after a back-off
                    lost = True
                    _log.debug("the will %r could not be held: %s", self._key, exc)
                    self._stopped.wait(jitter(backoff / 2, backoff))
                    backoff = min(backoff * 2, _BACKOFF_MAX)
        finally:
            if client is not None:
                try:
                    client.set_will(self._key, None)
                except Exception:  # noqa: BLE001 - closing anyway; the will may fire
                    _log.debug("the will %r could not be withdrawn", self._key)
                client.close()
