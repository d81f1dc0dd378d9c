"""The TCP store server: asyncio, speaking torch's TCPStore protocol.

Theory of operation
-------------------
One asyncio event loop serves every connection. The server runs its own
accept loop; each accepted socket becomes a
:class:`~rdzv.store._connection.Connection`, which parses the requests and
dispatches them (see that module). The store itself is a
:class:`~rdzv.store.engine.StoreEngine`, touched only from the loop's thread
(no locks).

Limits against misbehaving peers
--------------------------------
Each limit has a named default and a constructor parameter (see
:class:`TCPStoreServer`).

* Connections. Those in their handshake and those past it are capped
  apart, the caps fit the open-file limit, and the incomplete requests of
  all connections together are bounded (:mod:`rdzv.store.admission`). The
  accept loop backs off when accept fails anyway, and the log lines a
  flood repeats are throttled (:mod:`rdzv.store.throttle`).
* Work per connection: a turn of the loop parses and executes a bounded
  share of a connection's requests, and a peer that leaves its replies
  unread gets nothing more executed (:mod:`rdzv.store._connection`). The
  parser refuses oversize keys, values and key counts as soon as their
  length is readable, and costs time linear in a request's size however it
  is split. A ``WAIT`` of many keys is registered and removed in slices,
  one per turn (:mod:`rdzv.store.waiters`), and may name at most
  ``max_waited_keys`` keys.
* Time. Kernel keepalive probes find a peer gone without a FIN, even one
  blocked in a long ``WAIT``; one sweeper task closes every connection that
  broke ``frame_timeout`` (a request still incomplete that long after its
  first byte, replies left unread that long), the handshake deadline, or
  ``idle_timeout`` (which a connection blocked in a request it asked for
  never is: it waits for the server).

The server runs either in a background thread of the current process
(:meth:`TCPStoreServer.start`, what ``TCPStore(is_master=True)`` does) or in
the foreground until a signal (:meth:`TCPStoreServer.serve`, what
``rdzv serve`` does). Its event loop is the standard library's, or uvloop's
with ``loop="uvloop"`` (the ``rdzv[fast]`` extra), which is imported only
then: the same protocol callbacks run on either.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import signal
import socket
import ssl
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Final

from rdzv.net import bind_listeners, enable_keepalive, listen_backlog
from rdzv.store._connection import RECEIVE_BUFFER_BYTES, Connection, ConnectionLimits, Host
from rdzv.store.admission import Admission
from rdzv.store.engine import DEFAULT_MAX_WAITED_KEYS, DEFAULT_MAX_WAITING_BYTES, StoreEngine
from rdzv.store.protocol import DECODED_ITEM_OVERHEAD, MAX_MULTI_KEYS, MAX_REQUEST_BYTES
from rdzv.store.throttle import ThrottledLog
from rdzv.threads import start_thread

__all__ = [
    "ACCEPT_BACKLOG",
    "ACCEPT_BACKOFF",
    "DEFAULT_FRAME_TIMEOUT",
    "DEFAULT_HANDSHAKE_TIMEOUT",
    "DEFAULT_IDLE_TIMEOUT",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_CONNECTIONS_PER_ADDRESS",
    "DEFAULT_MAX_BUFFERED_BYTES",
    "DEFAULT_MAX_HANDSHAKES",
    "DEFAULT_MAX_UNSENT_BYTES",
    "DEFAULT_TCP_KEEPALIVE",
    "EVENT_LOOPS",
    "LOG_INTERVAL",
    "TCPStoreServer",
]


DEFAULT_MAX_CONNECTIONS: Final = 4096
"""Most client connections past the handshake a server keeps open at once."""
DEFAULT_MAX_HANDSHAKES: Final = 128
"""Most connections in their handshake (TLS, ``VALIDATE``, authentication) at once."""
DEFAULT_HANDSHAKE_TIMEOUT: Final = 10.0
"""Seconds within which a new connection must finish its handshake."""
DEFAULT_MAX_CONNECTIONS_PER_ADDRESS: Final[int | None] = None
"""None: three quarters of the connection cap without a secret, no cap with one."""
DEFAULT_MAX_UNSENT_BYTES: Final = 1 << 20
"""Bytes of replies a connection may leave unread before its requests wait."""
DEFAULT_MAX_BUFFERED_BYTES: Final = MAX_REQUEST_BYTES + 2 * MAX_MULTI_KEYS * DECODED_ITEM_OVERHEAD
"""Bytes held by received, unexecuted requests over every connection at once,
items already decoded from incomplete ones counted at their memory cost: one
request of the largest size, with the most items, fits."""
DEFAULT_FRAME_TIMEOUT: Final = 60.0
"""Seconds within which a started request (or the handshake) must arrive in full."""
DEFAULT_IDLE_TIMEOUT: Final[float | None] = None
"""Seconds a connection may sit with nothing pending; None never closes idle
connections (torch's client holds its connection idle for a whole job and
never reconnects, so the default keeps torch compatibility)."""
DEFAULT_TCP_KEEPALIVE: Final = 60.0
"""Seconds of silence before the kernel's first keepalive probe; dead after 6 more
probes 10 s apart, so a half-open peer is found in about two minutes."""
ACCEPT_BACKLOG: Final = 512
"""The largest listen backlog used (the kernel's ``somaxconn`` when smaller)."""
ACCEPT_BACKOFF: Final = 0.1
"""Longest pause of the accept loop while it lacks file descriptors or memory."""
LOG_INTERVAL: Final = 10.0
"""Seconds between two log lines of one kind that a flood of connections can repeat."""

EVENT_LOOPS: Final = ("asyncio", "uvloop")
"""The event loops a server can run on (``loop=``); the first is the default."""

_ACCEPT_OUT_OF_RESOURCES: Final = frozenset(
    {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
)


class TCPStoreServer(Admission):
    """A TCP store server speaking torch's TCPStore protocol.

    Its connection slots, caps and counters are those of its base,
    :class:`~rdzv.store.admission.Admission`.

    Args:
        host: The address to listen on, or several (one port for all, see
            :func:`~rdzv.net.listen_addresses`); None (the default) listens
            on every address, IPv6 and IPv4 (dual stack), falling back to
            IPv4 only.
        port: The port; 0 picks a free one (see :attr:`port`).
        auth_token: A shared secret; when given, clients must authenticate
            (rdzv clients only: torch's client cannot).
        ssl_context: A server-side TLS context; when given, connections use TLS.
        max_connections: Most connections past the handshake open at once
            (who is refused or shed, and the open-file limit: :mod:`rdzv.store.admission`).
        max_handshakes: Most connections still in their handshake (TLS,
            ``VALIDATE``, authentication) at once, apart from ``max_connections``.
        handshake_timeout: Seconds within which a new connection must finish
            its handshake (at most ``frame_timeout``).
        max_connections_per_address: Most connections past the handshake
            from one peer address. None (the default) is three quarters of
            the connection cap on a server without a secret, where anyone
            can finish the handshake, and no per-address cap with one.
        max_unsent_bytes: Replies a connection may leave unread before the
            server stops executing its requests until it reads.
        max_waiting_bytes: Bytes the blocked requests (``WAIT``, ``BARRIER``,
            ``GET_WAIT``, ``WATCH``) of all connections may hold together,
            counted as each key's length plus
            :data:`~rdzv.store.engine.WAITED_KEY_OVERHEAD`; a request that
            would pass it closes its connection with a warning naming the
            limit (default :data:`~rdzv.store.engine.DEFAULT_MAX_WAITING_BYTES`).
        max_waited_keys: Most keys one connection's ``WAIT`` may name (a
            connection has at most one blocked request); one naming more
            closes its connection with a warning naming the limit, as soon
            as its number of keys is read (default
            :data:`~rdzv.store.engine.DEFAULT_MAX_WAITED_KEYS`).
        max_buffered_bytes: Bytes held by requests not executed yet over all
            connections, counted and enforced as :mod:`rdzv.store.admission`
            says (default :data:`DEFAULT_MAX_BUFFERED_BYTES`).
        frame_timeout: Seconds within which a request must arrive in full once
            its first byte has, and for which a peer may leave its replies
            unread; a slower peer is disconnected.
        idle_timeout: Seconds after which a connection with nothing pending is
            closed; a connection blocked in a request it asked for (``WAIT``,
            ``WATCH``, ``BARRIER``...) is never idle. None (the default) keeps
            idle connections, as torch's clients expect.
        tcp_keepalive: Seconds of silence before the kernel probes a peer
            (then every 10 s; 6 unanswered probes close the connection), so
            half-open connections go away; None turns keepalive off.
        loop: The event loop, one of :data:`EVENT_LOOPS`: ``"asyncio"`` (the
            default, the standard library's) or ``"uvloop"`` (needs the
            ``uvloop`` package, the ``rdzv[fast]`` extra).

    Raises:
        ValueError: ``port`` is out of range, ``auth_token`` is empty, a
            limit is not positive or ``loop`` is unknown (the message names it).
        ImportError: ``loop="uvloop"`` and uvloop is not installed.
    """

    def __init__(
        self,
        host: str | Sequence[str] | None = None,
        port: int = 0,
        *,
        auth_token: str | bytes | None = None,
        ssl_context: ssl.SSLContext | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_handshakes: int = DEFAULT_MAX_HANDSHAKES,
        handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
        max_connections_per_address: int | None = DEFAULT_MAX_CONNECTIONS_PER_ADDRESS,
        max_unsent_bytes: int = DEFAULT_MAX_UNSENT_BYTES,
        max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES,
        max_waiting_bytes: int = DEFAULT_MAX_WAITING_BYTES,
        max_waited_keys: int = DEFAULT_MAX_WAITED_KEYS,
        frame_timeout: float = DEFAULT_FRAME_TIMEOUT,
        idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT,
        tcp_keepalive: float | None = DEFAULT_TCP_KEEPALIVE,
        loop: str = EVENT_LOOPS[0],
    ) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {port}")
        if auth_token is not None and not auth_token:
            raise ValueError("auth_token must not be empty")
        for name, count in (
            ("max_connections", max_connections),
            ("max_handshakes", max_handshakes),
            ("max_connections_per_address", max_connections_per_address),
            ("max_unsent_bytes", max_unsent_bytes),
            ("max_buffered_bytes", max_buffered_bytes),
            ("max_waiting_bytes", max_waiting_bytes),
            ("max_waited_keys", max_waited_keys),
        ):
            if count is not None and count < 1:
                raise ValueError(f"{name} must be at least 1, got {count}")
        for name, value in (
            ("handshake_timeout", handshake_timeout),
            ("frame_timeout", frame_timeout),
            ("idle_timeout", idle_timeout),
            ("tcp_keepalive", tcp_keepalive),
        ):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        self._run = _loop_runner(loop)
        super().__init__(
            max_connections,
            max_handshakes,
            max_connections_per_address,
            max_buffered_bytes,
            handshake_timeout,
            auth_token is not None,
            ThrottledLog(LOG_INTERVAL),
        )
        self.loop = loop
        """The event loop's name (one of :data:`EVENT_LOOPS`)."""
        self.max_unsent_bytes = max_unsent_bytes
        self.handshake_timeout = float(handshake_timeout)
        self.frame_timeout = float(frame_timeout)
        self.handshake_deadline = min(self.handshake_timeout, self.frame_timeout)
        """Seconds a connection may spend in its handshake."""
        self.idle_timeout = None if idle_timeout is None else float(idle_timeout)
        self.tcp_keepalive = None if tcp_keepalive is None else float(tcp_keepalive)
        self.expired_connections = 0
        """Connections closed for breaking ``frame_timeout``, ``idle_timeout``
        or the handshake deadline."""
        self._hosts = [host] if isinstance(host, str) else None if host is None else list(host)
        self._requested_port = port
        self.secret = auth_token.encode() if isinstance(auth_token, str) else auth_token
        self._ssl_context = ssl_context
        self.engine: StoreEngine[Connection] = StoreEngine(
            max_waiting_bytes, max_waited_keys, self._schedule_work
        )
        limits = ConnectionLimits(
            max_unsent_bytes,
            self.handshake_deadline,
            self.frame_timeout,
            self.idle_timeout,
            self.secret,
        )
        buffer = memoryview(bytearray(RECEIVE_BUFFER_BYTES))
        self._connections_host = Host(self.engine, self, limits, self.throttled, buffer)
        self._work_scheduled = False
        self._port: int | None = None
        self._bound_host = self._hosts[0] if self._hosts else "::"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def port(self) -> int:
        """The port the server listens on.

        Raises:
            RuntimeError: The server is not running.
        """
        if self._port is None:
            raise RuntimeError("the store server is not running")
        return self._port

    @property
    def host(self) -> str:
        """The (first) address the server listens on (``::`` for every address)."""
        return self._bound_host

    @property
    def requests(self) -> int:
        """Requests parsed since the server started."""
        return self._connections_host.requests

    @property
    def running(self) -> bool:
        """Whether the server is listening."""
        return self._port is not None

    def start(self) -> TCPStoreServer:
        """Start serving in a background (daemon) thread; return this server once bound.

        Raises:
            OSError: The address could not be bound.
            RuntimeError: The server was already started.
        """
        if self._thread is not None:
            raise RuntimeError("the store server was already started")
        self._thread = start_thread(lambda: self._run(self._main(None)), name="rdzv-store-server")
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            self._thread = None
            raise self._error
        return self

    def stop(self) -> None:
        """Stop serving, close every connection and join the thread (idempotent)."""
        loop, stop, thread = self._loop, self._stop, self._thread
        if loop is not None and stop is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)
        if thread is not None and thread is not threading.current_thread():
            thread.join()
            self._thread = None

    def serve(self, on_ready: Callable[[TCPStoreServer], None] | None = None) -> None:
        """Serve in the current thread until SIGTERM or SIGINT (or :meth:`stop`).

        ``on_ready`` is called once the server is bound, e.g. to print the address.

        Raises:
            OSError: The address could not be bound.
        """
        self._run(self._main(on_ready, install_signals=True))
        if self._error is not None:
            raise self._error

    def waiter_count(self) -> int:
        """Return the number of blocked requests (for tests and monitoring)."""
        return self._call(lambda: self.engine.waiter_count)

    def connection_count(self) -> int:
        """Return the number of open client connections, handshakes included."""
        return self._call(lambda: len(self.connections) + len(self.handshaking))

    def _call(self, func: Callable[[], int]) -> int:
        loop = self._loop
        if loop is None:
            return func()
        if self._thread is threading.current_thread():
            return func()

        async def run() -> int:
            return func()

        return asyncio.run_coroutine_threadsafe(run(), loop).result(timeout=30)

    def __enter__(self) -> TCPStoreServer:
        if self._thread is None:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- on the loop's thread -------------------------------------------------

    def _schedule_work(self) -> None:
        """Have the engine's sliced work (large blocked requests) done, a slice per turn."""
        if not self._work_scheduled:
            self._work_scheduled = True
            asyncio.get_running_loop().call_soon(self._work)

    def _work(self) -> None:
        self._work_scheduled = False
        for conn, answer in self.engine.work():
            conn.answer(answer)
        if self.engine.has_work:
            self._schedule_work()

    def _accepted(self, sock: socket.socket, address: str, peer: str) -> None:
        """Take in a connection just accepted, or refuse it (close it at once)."""
        if not self.make_room(address, peer, time.monotonic()):
            sock.close()
            return
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.tcp_keepalive is not None:
            enable_keepalive(sock, self.tcp_keepalive)
        conn = Connection(self._connections_host, address, peer)
        self.handshaking[conn] = None
        conn.attaching = asyncio.get_running_loop().create_task(self._attach(conn, sock))
        conn.attaching.add_done_callback(lambda task: _close_if_cancelled(task, sock))

    async def _attach(self, conn: Connection, sock: socket.socket) -> None:
        """Give ``conn`` its transport, after the TLS handshake on a TLS server."""
        loop = asyncio.get_running_loop()
        context = self._ssl_context
        try:
            if context is None:
                await loop.connect_accepted_socket(lambda: conn, sock)
            else:
                await loop.connect_accepted_socket(
                    lambda: conn, sock, ssl=context, ssl_handshake_timeout=self.handshake_deadline
                )
        except asyncio.CancelledError:
            self.release(conn)
            sock.close()
        except (OSError, ssl.SSLError, TimeoutError) as exc:
            self.release(conn)
            sock.close()
            self.throttled.warning(
                "tls", "store client %s disconnected: TLS handshake failed: %s", conn.peer, exc
            )
        finally:
            conn.attaching = None

    async def _accept(self, listener: socket.socket) -> None:
        """Accept connections until cancelled, backing off when out of files.

        Every accepted connection is taken in or refused (closed) at once,
        which costs a few microseconds, and the loop yields to the
        connections after each. An accept that fails for lack of file
        descriptors or memory waits twice as long as the last one did (up
        to :data:`ACCEPT_BACKOFF`) before the next, and is logged at most
        once per :data:`LOG_INTERVAL`: no busy loop, no flood of log lines.
        """
        loop = asyncio.get_running_loop()
        delay = 0.0
        while True:
            accepting = loop.create_task(loop.sock_accept(listener))
            try:
                sock, addr = await asyncio.shield(accepting)
            except asyncio.CancelledError:
                # Stopping: a connection accepted meanwhile must not leak.
                accepting.add_done_callback(_close_accepted)
                accepting.cancel()
                raise
            except OSError as exc:
                if exc.errno not in _ACCEPT_OUT_OF_RESOURCES:
                    continue  # the peer went away between SYN and accept
                delay = min(ACCEPT_BACKOFF, max(0.01, delay * 2))
                self.throttled.warning(
                    "accept",
                    "store server cannot accept connections (%s); retrying in %.2f s",
                    exc,
                    delay,
                )
                await asyncio.sleep(delay)
                continue
            delay = 0.0
            address = str(addr[0])
            self._accepted(sock, address, f"{address}:{addr[1]}")
            await asyncio.sleep(0)  # accepting must not starve the connections

    async def _main(
        self, on_ready: Callable[[TCPStoreServer], None] | None, *, install_signals: bool = False
    ) -> None:
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            listeners = bind_listeners(self._hosts, self._requested_port)
            for sock in listeners:
                sock.listen(min(listen_backlog(), ACCEPT_BACKLOG))
                sock.setblocking(False)
        except (OSError, ValueError) as exc:
            self._error = exc
            self._ready.set()
            return
        self.fit_descriptor_limit()
        address = listeners[0].getsockname()
        self._bound_host = str(address[0])
        self._port = int(address[1])
        self._loop = loop
        if install_signals:
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(signum, self._stop.set)
        self._ready.set()
        tasks = [loop.create_task(self._sweep())]
        tasks += [loop.create_task(self._accept(sock)) for sock in listeners]
        try:
            if on_ready is not None:
                on_ready(self)
            await self._stop.wait()
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            for sock in listeners:
                sock.close()
            for conn in [*self.handshaking, *self.connections]:
                conn.abort()
            for _ in range(3):
                await asyncio.sleep(0)
            if install_signals:
                for signum in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(signum)
            self._port = None
            self._loop = None

    async def _sweep(self) -> None:
        """Close, periodically, every connection that broke a time limit."""
        limits = [self.frame_timeout, self.handshake_deadline]
        if self.idle_timeout is not None:
            limits.append(self.idle_timeout)
        period = min(1.0, max(0.05, min(limits) / 4))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for conn in [*self.handshaking, *self.connections]:
                reason = conn.expired(now)
                if reason is not None:
                    self.expired_connections += 1
                    kind = None if conn.is_open else "handshake"
                    self.throttled.warning(
                        kind, "store client %s disconnected: %s", conn.peer, reason
                    )
                    conn.abort()


def _close_accepted(task: asyncio.Task[tuple[socket.socket, Any]]) -> None:
    """Close what an accept task accepted after the accept loop was stopped."""
    if not task.cancelled() and task.exception() is None:
        task.result()[0].close()


def _close_if_cancelled(task: asyncio.Task[None], sock: socket.socket) -> None:
    """Close the socket of an attach task cancelled before it ran (the server stopped)."""
    if task.cancelled():
        sock.close()


def _loop_runner(loop: str) -> Callable[[Coroutine[Any, Any, None]], None]:
    """Return what runs the server's main coroutine on the event loop named ``loop``.

    Raises:
        ValueError: ``loop`` is not one of :data:`EVENT_LOOPS`.
        ImportError: ``loop`` is ``"uvloop"`` and uvloop is not installed.
    """
    if loop == "asyncio":
        return asyncio.run
    if loop != "uvloop":
        raise ValueError(f"loop must be one of {', '.join(EVENT_LOOPS)}, got {loop!r}")
    try:
        import uvloop  # noqa: PLC0415 - an optional extra, imported only when asked for
    except ImportError as exc:
        raise ImportError(
            "loop 'uvloop' needs the uvloop package (the rdzv[fast] extra), which is not "
            "installed: pip install uvloop"
        ) from exc
    return uvloop.run
