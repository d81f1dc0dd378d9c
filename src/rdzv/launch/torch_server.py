"""torch's libuv ``TCPStore`` server as the workers' bootstrap store.

The workers' ``init_process_group`` speaks torch's store protocol; torch's
libuv server runs its accept and request loop on a C++ thread that never
takes the interpreter lock, so the agent hosting it keeps its own threads
(the rendezvous keep-alive) running while thousands of workers connect.

The listening socket is made here and handed over as torch's
``master_listen_fd``, so the store listens on the address chosen for it (or
every address) and its port is known before torch starts serving. torch
owns the descriptor from then on and closes it with the server. Closing the
server drops the only reference to torch's store, whose destructor stops the
loop and closes every connection.

torch is imported on the first call only.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any, Final

__all__ = ["TorchStoreServer", "torch_store_server"]

# The timeout of the hosting agent's own client of the store.
_OWN_CLIENT_TIMEOUT: Final = timedelta(seconds=60)


class TorchStoreServer:
    """A running torch libuv store server.

    Args:
        store: torch's ``TCPStore(is_master=True)``, the server's only owner.
        port: The port it listens on.
    """

    def __init__(self, store: Any, port: int) -> None:
        self._store: Any = store
        self._port = port

    @property
    def port(self) -> int:
        """The port the server listens on."""
        return self._port

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._store is None

    def close(self) -> None:
        """Stop the server: its last reference goes, and torch stops the loop."""
        self._store = None


def _listening_socket(host: str | None, backlog: int) -> socket.socket:
    """Bind a TCP socket to ``host`` (every address when None) on a free port and listen."""
    if host is None:
        if socket.has_dualstack_ipv6():
            return socket.create_server(
                ("", 0), family=socket.AF_INET6, backlog=backlog, dualstack_ipv6=True
            )
        return socket.create_server(("", 0), backlog=backlog)
    family, _type, _proto, _name, address = socket.getaddrinfo(
        host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    return socket.create_server(address[:2], family=family, backlog=backlog)


def torch_store_server(host: str | None, backlog: int) -> TorchStoreServer:
    """Start torch's libuv store server on a free port of ``host`` (every address when None).

    Args:
        host: The address to listen on.
        backlog: The listen backlog asked for (the kernel caps it at
            ``net.core.somaxconn``).

    Raises:
        ImportError: torch is not installed.
    """
    from torch._C._distributed_c10d import TCPStore  # noqa: PLC0415 - torch only when chosen

    sock = _listening_socket(host, backlog)
    port: int = sock.getsockname()[1]
    own = "127.0.0.1" if host is None else host
    try:
        store = TCPStore(
            own,
            port,
            None,
            True,
            _OWN_CLIENT_TIMEOUT,
            wait_for_workers=False,
            master_listen_fd=sock.fileno(),
            use_libuv=True,
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # torch's server owns the descriptor now
    return TorchStoreServer(store, port)
