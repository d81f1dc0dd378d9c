"""A fault-injecting TCP proxy on loopback: cut every connection, delay traffic.

Each accepted connection gets one thread per direction, copying chunks from
one socket to the other. ``delay`` seconds are slept before each chunk is
forwarded (latency); :meth:`FaultProxy.cut` closes every open connection at
once (both sides see a reset or EOF). The target can be changed while
running, e.g. after the store host restarted on another port.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time


class FaultProxy:
    """Forward ``127.0.0.1:port`` to a target, injecting faults on request.

    Args:
        target_port: The loopback port to forward to.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.delay = 0.0
        self.cuts = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self._pairs: set[tuple[socket.socket, socket.socket]] = set()
        self._threads: list[threading.Thread] = []
        self._stopped = threading.Event()
        self._acceptor = threading.Thread(target=self._accept, name="chaos-proxy", daemon=True)
        self._acceptor.start()

    def cut(self) -> int:
        """Close every open connection; return how many were cut."""
        with self._lock:
            pairs = list(self._pairs)
            self._pairs.clear()
        for pair in pairs:
            for sock in pair:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        self.cuts += len(pairs)
        return len(pairs)

    def close(self) -> None:
        """Stop accepting, cut everything and join the threads."""
        self._stopped.set()
        self._acceptor.join(10)
        self.cut()
        for thread in self._threads:
            thread.join(10)
        self._listener.close()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=2)
            except OSError:
                client.close()  # the target is down: the client sees a closed connection
                continue
            pair = (client, upstream)
            with self._lock:
                self._pairs.add(pair)
            self._threads = [t for t in self._threads if t.is_alive()]
            for src, dst in ((client, upstream), (upstream, client)):
                thread = threading.Thread(target=self._pump, args=(src, dst, pair), daemon=True)
                thread.start()
                self._threads.append(thread)

    def _pump(
        self, src: socket.socket, dst: socket.socket, pair: tuple[socket.socket, socket.socket]
    ) -> None:
        try:
            while not self._stopped.is_set():
                ready, _, _ = select.select([src], [], [], 0.2)
                if not ready:
                    continue
                data = src.recv(65536)
                if not data:
                    break
                if self.delay:
                    time.sleep(self.delay)
                dst.sendall(data)
        except (OSError, ValueError):
            pass
        finally:
            with self._lock:
                self._pairs.discard(pair)
            for sock in pair:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            # Each direction's thread closes only the socket it reads from.
            src.close()
