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
        "the rdzv Redis backend needs redis-py; install it with: pip install 'redis>=4.5' "
        "(or pip install '.[redis]' in rdzv's source tree)"
    ) from exc

from rdzv.endpoint import format_endpoint
from rdzv.errors import RendezvousConnectionError, RendezvousStateError

if TYPE_CHECKING:
    from rdzv.backends.options import RedisOptions

__all__ = [
    "MAX_BLOCK_SECONDS",
    "as_bytes",
    "create_client",
    "endpoint_of",
    "redis_errors",
]

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


def create_client(options: RedisOptions) -> redis.Redis:
    """Build a redis-py client from parsed options.

    Args:
        options: The Redis options.

    Returns:
        The client (no connection is made yet).
    """
    return redis.Redis(
        host=options.host,
        port=options.port,
        db=options.db,
        password=options.password,
        socket_timeout=options.read_timeout + MAX_BLOCK_SECONDS,
        socket_connect_timeout=min(options.read_timeout, 10.0),
        ssl=options.use_tls,
        ssl_certfile=options.ssl_cert,
        ssl_keyfile=options.ssl_cert_key,
        ssl_ca_certs=options.ca_cert,
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
