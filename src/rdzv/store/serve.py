"""Serving a store with a shared secret and TLS: the one way every host builds its server.

``rdzv serve``, ``TCPStore(is_master=True)`` (and so the c10d backend's
hosting node) and the torchrun plugin's server child all build their server
with :func:`secured_server`. What secures it is a :class:`ServerSecurity`:
made from already-resolved values (the library API), or from files with
:meth:`ServerSecurity.from_files`, where the secret comes from a file or else
``$RDZV_AUTH_TOKEN`` (never the command line, see :mod:`rdzv.auth`) and the
TLS context from a certificate and its key.
"""

from __future__ import annotations

import errno
import os
import ssl
from dataclasses import dataclass, field
from typing import Any

from rdzv.auth import resolve_auth_token
from rdzv.net import server_tls_context
from rdzv.store.server import TCPStoreServer

__all__ = ["ServerSecurity", "secured_server"]


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

        Returns:
            The security settings.

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
    host: str | None, port: int, security: ServerSecurity, **limits: Any
) -> TCPStoreServer:
    """Build (not start) a store server secured by ``security``.

    Args:
        host: The address to listen on; None for every address.
        port: The port (0 picks a free one).
        security: The secret and TLS context.
        **limits: :class:`~rdzv.store.server.TCPStoreServer`'s limits
            (``max_connections``, ``frame_timeout``, ``idle_timeout`` ...).

    Returns:
        The server; call ``start()`` (a background thread) or ``serve()``
        (the foreground).
    """
    return TCPStoreServer(
        host, port, auth_token=security.auth_token, ssl_context=security.ssl_context, **limits
    )
