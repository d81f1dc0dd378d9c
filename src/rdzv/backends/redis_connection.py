"""Connecting to Redis: building a redis-py client and translating its errors.

Only modules of the ``rdzv[redis]`` extra import this (it imports redis-py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

try:
    import redis
    import redis.exceptions
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        "the rdzv Redis backend needs redis-py; install it with: pip install 'rdzv[redis]'"
    ) from exc

from rdzv.backends.base import text_option
from rdzv.endpoint import format_endpoint, parse_endpoint
from rdzv.errors import RendezvousConnectionError, RendezvousStateError

if TYPE_CHECKING:
    from rdzv.api import RendezvousParameters

__all__ = [
    "DEFAULT_REDIS_PORT",
    "MAX_BLOCK_SECONDS",
    "as_bytes",
    "create_client",
    "endpoint_of",
    "redis_errors",
]

DEFAULT_REDIS_PORT = 6379
# The longest single blocking command (XREAD BLOCK, BLPOP); longer waits loop,
# so a block never outlasts the socket timeout.
MAX_BLOCK_SECONDS = 5.0


@contextlib.contextmanager
def redis_errors(endpoint: str, what: str) -> Iterator[None]:
    """Translate redis-py errors into rdzv errors naming the endpoint.

    Args:
        endpoint: ``host:port`` of the server, for messages.
        what: What was being done, for messages.

    Yields:
        Nothing; the body runs inside the translation.

    Raises:
        RendezvousConnectionError: The server could not be reached or timed out.
        RendezvousStateError: The server rejected the command.
    """
    try:
        yield
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
        raise RendezvousConnectionError(
            f"Redis at {endpoint} could not be reached while {what}: {exc}"
        ) from exc
    except redis.exceptions.ResponseError as exc:
        raise RendezvousStateError(f"Redis at {endpoint} rejected {what}: {exc}") from exc
    except redis.exceptions.RedisError as exc:
        raise RendezvousConnectionError(f"Redis at {endpoint} failed while {what}: {exc}") from exc


def endpoint_of(client: redis.Redis) -> str:
    """Return ``host:port`` of a client's server, for messages.

    Args:
        client: The client.

    Returns:
        The endpoint text.
    """
    kwargs: dict[str, Any] = client.connection_pool.connection_kwargs
    return format_endpoint(str(kwargs.get("host", "?")), int(kwargs.get("port", 0)))


def create_client(params: RendezvousParameters) -> redis.Redis:
    """Build a redis-py client from rendezvous parameters.

    Options: ``read_timeout`` (seconds, 60), ``protocol`` (``redis`` or
    ``rediss`` for TLS; ``http``/``https`` are accepted as synonyms),
    ``ssl_cert``, ``ssl_cert_key``, ``ca_cert``, ``password``, ``db`` (0).

    Args:
        params: The parameters; ``endpoint`` is ``host[:port]`` (port 6379).

    Returns:
        The client (no connection is made yet).

    Raises:
        ValueError: An option or the endpoint is invalid.
    """
    host, port = parse_endpoint(params.endpoint, DEFAULT_REDIS_PORT)
    read_timeout = params.get_as_seconds("read_timeout") or 60.0
    protocol = (text_option(params, "protocol") or "redis").lower()
    if protocol not in ("redis", "rediss", "http", "https"):
        raise ValueError(f"the Redis protocol must be 'redis' or 'rediss', got {protocol!r}")
    use_tls = protocol in ("rediss", "https")
    cert, key, ca = (
        text_option(params, "ssl_cert"),
        text_option(params, "ssl_cert_key"),
        text_option(params, "ca_cert"),
    )
    if not use_tls and (cert or key or ca):
        raise ValueError("ssl_cert, ssl_cert_key and ca_cert need protocol=rediss")
    return redis.Redis(
        host=host,
        port=port,
        db=params.get_as_int("db", 0) or 0,
        password=text_option(params, "password"),
        socket_timeout=read_timeout + MAX_BLOCK_SECONDS,
        socket_connect_timeout=min(read_timeout, 10.0),
        ssl=use_tls,
        ssl_certfile=cert,
        ssl_keyfile=key,
        ssl_ca_certs=ca,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 3),
    )


def as_bytes(value: Any) -> bytes:
    """Return a reply item as bytes (redis-py types replies loosely).

    Args:
        value: A reply item: bytes, or a str or int that Redis sent.

    Returns:
        The bytes.

    Raises:
        RendezvousStateError: The item is a nested reply or None.
    """
    if isinstance(value, bytes):
        return value
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        return str(value).encode()
    raise RendezvousStateError(f"Redis sent {value!r} where a string was expected")
