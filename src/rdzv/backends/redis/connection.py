"""Connecting to Redis: building a redis-py client and translating its errors.

Only modules of the ``rdzv[redis]`` extra import this (it imports redis-py).

The client honours the caller's deadline (:func:`rdzv.retry.deadline_within`):
its connections cap the connect timeout and each reply's socket timeout by
the time left (:func:`rdzv.retry.time_left`), and its retry object stops
retrying once the deadline has passed. A paused or blackholed server then
costs a rendezvous call its own deadline, not ``read_timeout`` times
redis-py's retries.
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
from rdzv.retry import Deadline, caller_deadline, time_left

if TYPE_CHECKING:
    from rdzv.backends.options import RedisOptions

__all__ = [
    "MAX_BLOCK_SECONDS",
    "as_bytes",
    "block_on_stream",
    "create_client",
    "endpoint_of",
    "redis_errors",
]

# The longest single blocking command (XREAD BLOCK, BLPOP); longer waits loop,
# so a block never outlasts the socket timeout.
MAX_BLOCK_SECONDS = 5.0


def block_on_stream(
    client: redis.Redis, endpoint: str, stream: str, last_id: bytes, deadline: Deadline
) -> bool:
    """Block until ``stream`` has an entry after ``last_id``; False once ``deadline`` passed without.

    The wait is cut into ``XREAD BLOCK`` slices of at most
    :data:`MAX_BLOCK_SECONDS`, each from the same id: a slice that ends
    empty proves nothing was written, so the caller's keys need no read
    again before the next slice. Whether to block again is the deadline's
    clock's, which may move meanwhile (a test's autojump clock); a slice's
    length is the time left on it.
    """
    while (remaining := deadline.left()) > 0:
        block_ms = max(1, int(min(remaining, MAX_BLOCK_SECONDS) * 1000))
        with deadline.clock.blocking(remaining), redis_errors(endpoint, "waiting for a change"):
            if client.xread({stream: last_id}, count=1, block=block_ms):
                return True
    return False


@contextlib.contextmanager
def redis_errors(endpoint: str, what: str) -> Iterator[None]:
    """Translate redis-py errors into rdzv errors naming the ``endpoint`` and ``what`` was done.

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


class _DeadlineRetry(Retry):
    """redis-py's retry, which makes no new attempt once the caller's deadline has passed."""

    def call_with_retry(self, do: Any, fail: Any, *args: Any, **kwargs: Any) -> Any:
        def failed(error: Exception, *more: Any) -> None:
            fail(error, *more)
            deadline = caller_deadline()
            if deadline is not None and deadline.left() <= 0:
                raise error

        return super().call_with_retry(do, failed, *args, **kwargs)


class _DeadlineConnection:
    """Mixed into redis-py's connection class: timeouts capped by the caller's deadline."""

    _sock: Any
    socket_timeout: float | None

    @property
    def socket_connect_timeout(self) -> float | None:
        # redis-py 5+ stores it as _socket_connect_timeout, older versions assign the attribute.
        fields = self.__dict__
        limit: float | None = fields.get(
            "_rdzv_connect_timeout", fields.get("_socket_connect_timeout")
        )
        return limit if caller_deadline() is None else time_left(limit or _NO_LIMIT)

    @socket_connect_timeout.setter
    def socket_connect_timeout(self, value: float | None) -> None:
        self.__dict__["_rdzv_connect_timeout"] = value

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        sock = self._sock
        if sock is None or caller_deadline() is None:
            return super().read_response(*args, **kwargs)  # type: ignore[misc]
        sock.settimeout(time_left(self.socket_timeout or _NO_LIMIT))
        try:
            return super().read_response(*args, **kwargs)  # type: ignore[misc]
        finally:
            if self._sock is sock:
                sock.settimeout(self.socket_timeout)


_NO_LIMIT = 365 * 24 * 3600.0
"""A stand-in for "no timeout" when capping one by the caller's deadline."""


def _bounded(client: redis.Redis) -> redis.Redis:
    """Make ``client``'s pool build connections that honour the caller's deadline."""
    pool = client.connection_pool
    base: type[Any] = pool.connection_class
    pool.connection_class = type(f"Deadline{base.__name__}", (_DeadlineConnection, base), {})
    return client


def endpoint_of(client: redis.Redis) -> str:
    """Return ``host:port`` of a client's server, for messages."""
    kwargs: dict[str, Any] = client.connection_pool.connection_kwargs
    return format_endpoint(str(kwargs.get("host", "?")), int(kwargs.get("port", 0)))


def create_client(options: RedisOptions) -> redis.Redis:
    """Build a redis-py client from parsed options (no connection is made yet)."""
    return _bounded(
        redis.Redis(
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
            retry=_DeadlineRetry(ExponentialBackoff(cap=0.5, base=0.05), 3),
        )
    )


def as_bytes(value: Any) -> bytes:
    """Return a reply item as bytes (redis-py types replies loosely).

    Raises:
        RendezvousStateError: The item is a nested reply or None.
    """
    if isinstance(value, bytes):
        return value
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        return str(value).encode()
    raise RendezvousStateError(f"Redis sent {value!r} where a string was expected")
