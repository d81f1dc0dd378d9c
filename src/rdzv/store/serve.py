"""Serving a store with a shared secret and TLS: the one way every host builds its server.

``rdzv serve``, ``TCPStore(is_master=True)`` (and so the c10d backend's
hosting node) and the torchrun plugin's server child all build their server
with :func:`secured_server`. What secures it is a :class:`ServerSecurity`:
made from already-resolved values (the library API), or from files with
:meth:`ServerSecurity.from_files`, where the secret comes from a file or else
``$RDZV_AUTH_TOKEN`` (never the command line, see :mod:`rdzv.auth`) and the
TLS context from a certificate and its key. The masters of one process may
share one server per port (``TCPStore(multi_tenant=True)``):
:func:`hosted_server` and :func:`release_server` count its users.
"""

from __future__ import annotations

import errno
import os
import ssl
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rdzv.auth import resolve_auth_token
from rdzv.net import server_tls_context
from rdzv.store.server import TCPStoreServer

__all__ = ["ServerSecurity", "hosted_server", "release_server", "secured_server"]


@dataclass(frozen=True)
class ServerSecurity:
    """What secures a store server.

    Args:
        auth_token: The shared secret clients must prove, or None.
        ssl_context: The server-side TLS context, or None for plain TCP.
    """

    auth_token: bytes | None = field(default=None, repr=False)
    ssl_context: ssl.SSLContext | None = None

    @classmethod
    def from_files(
        cls, auth_token_file: str | None, tls_cert: str | None, tls_key: str | None
    ) -> ServerSecurity:
        """Read the secret and the TLS certificate from files.

        Args:
            auth_token_file: A file holding the secret (surrounding
                whitespace stripped); None reads ``$RDZV_AUTH_TOKEN``, if set.
            tls_cert: A PEM certificate chain; enables TLS with ``tls_key``.
            tls_key: The PEM private key of ``tls_cert``.

        Raises:
            ValueError: Only one of ``tls_cert`` and ``tls_key`` is given, or
                the secret file is empty.
            OSError: A file cannot be read (its ``filename`` names it).
            ssl.SSLError: The certificate and key do not match.
        """
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("--tls-cert and --tls-key must be given together")
        token = resolve_auth_token(auth_token_file)
        context = None
        if tls_cert is not None and tls_key is not None:
            for path in (tls_cert, tls_key):
                if not os.path.isfile(path):  # ssl's own error does not name the file
                    raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
            context = server_tls_context(tls_cert, tls_key)
        return cls(token, context)

    @property
    def features(self) -> list[str]:
        """What is on, for messages: ``auth``, ``tls``."""
        return [name for name, on in (("auth", self.auth_token), ("tls", self.ssl_context)) if on]


def secured_server(
    host: str | Sequence[str] | None, port: int, security: ServerSecurity, **limits: Any
) -> TCPStoreServer:
    """Build (not start) a store server secured by ``security``.

    ``host`` is an address or several; None listens on every address,
    ``port`` 0 picks a free one, and
    ``limits`` are :class:`~rdzv.store.server.TCPStoreServer`'s. Call
    ``start()`` (a background thread) or ``serve()`` (the foreground).
    """
    return TCPStoreServer(
        host, port, auth_token=security.auth_token, ssl_context=security.ssl_context, **limits
    )


_shared_lock = threading.Lock()
_shared_servers: dict[int, tuple[TCPStoreServer, int]] = {}
"""The servers the masters of this process share, by port, with their user counts."""


def hosted_server(
    port: int,
    multi_tenant: bool,
    security: ServerSecurity,
    max_connections: int | None = None,
    listen: Sequence[str] | None = None,
) -> TCPStoreServer:
    """Start a ``TCPStore(is_master=True)``'s server, or share the one on ``port``.

    With ``multi_tenant``, this process's masters on one port share one
    server (listening where the first asked); each gives it back with
    :func:`release_server`. ``listen``: the addresses to listen on, None every one.
    """
    with _shared_lock:
        if multi_tenant and port in _shared_servers:
            server, users = _shared_servers[port]
            _shared_servers[port] = (server, users + 1)
            return server
        limits = {} if max_connections is None else {"max_connections": max_connections}
        server = secured_server(listen, port, security, **limits).start()
        if multi_tenant:
            _shared_servers[server.port] = (server, 1)
        return server


def release_server(server: TCPStoreServer, multi_tenant: bool) -> None:
    """Stop a server of :func:`hosted_server`, unless other masters still share it."""
    with _shared_lock:
        if multi_tenant:
            for port, (shared, users) in list(_shared_servers.items()):
                if shared is server:
                    if users > 1:
                        _shared_servers[port] = (shared, users - 1)
                        return
                    del _shared_servers[port]
        server.stop()
