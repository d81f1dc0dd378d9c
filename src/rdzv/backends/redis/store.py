"""A :class:`rdzv.Store` kept in Redis (extra ``rdzv[redis]``).

Theory of operation
-------------------
Keys are Redis strings named ``<prefix>k:<key>``; queues are lists named
``<prefix>q:<key>``. Every write to a key runs as a Lua script that also
appends the key's name to one change stream, ``<prefix>events``, in the same
atomic step. A read that must wait (``get``, ``wait``, ``watch``) reads its
keys and the stream's last entry id in one script, then blocks in ``XREAD``
from that id and reads again once a write came: a write in between cannot
be missed. Queue pops block in ``BLPOP``. Waits are cut into slices shorter
than the socket timeout, each from the same id (a slice that ends empty
proves nothing was written, so it costs no read), and stop at the deadline.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from rdzv.backends.redis.connection import (
    MAX_BLOCK_SECONDS,
    as_bytes,
    block_on_stream,
    endpoint_of,
    redis_errors,
)
from rdzv.errors import RendezvousStateError, StoreTimeoutError
from rdzv.retry import Deadline, current_clock
from rdzv.store.base import (
    DEFAULT_STORE_TIMEOUT,
    Store,
    Timeout,
    Value,
    check_multi_set,
    to_bytes,
    to_seconds,
)

if TYPE_CHECKING:
    import redis

__all__ = ["RedisStore"]

_T = TypeVar("_T")
_STREAM_MAXLEN = "1000"

# Every write script ends by appending to the change stream KEYS[#KEYS].
_NOTIFY = """
local stream = KEYS[#KEYS]
redis.call('XADD', stream, 'MAXLEN', '~', ARGV[#ARGV], '*', 'k', KEYS[1])
"""

_SET = (
    """
for i = 1, #KEYS - 1 do redis.call('SET', KEYS[i], ARGV[i]) end
"""
    + _NOTIFY
)

_ADD = (
    """
local n = redis.call('INCRBY', KEYS[1], ARGV[1])
"""
    + _NOTIFY
    + "return n\n"
)

_APPEND = (
    """
redis.call('APPEND', KEYS[1], ARGV[1])
"""
    + _NOTIFY
)

_DELETE = """
local n = redis.call('DEL', KEYS[1])
if n > 0 then
"""
_DELETE += _NOTIFY + "end\nreturn n\n"

_COMPARE_SET = """
local cur = redis.call('GET', KEYS[1])
local write = false
if cur == false then
  if ARGV[1] ~= '' then return ARGV[1] end
  write = true
elseif cur == ARGV[1] then
  write = true
end
if not write then return cur end
redis.call('SET', KEYS[1], ARGV[2])
"""
_COMPARE_SET += _NOTIFY + "return ARGV[2]\n"

_READ = """
local stream = KEYS[#KEYS]
local last = redis.call('XREVRANGE', stream, '+', '-', 'COUNT', 1)
local id = '0-0'
if #last > 0 then id = last[1][1] end
local values = {}
for i = 1, #KEYS - 1 do
  local v = redis.call('GET', KEYS[i])
  if v == false then values[i] = {0} else values[i] = {1, v} end
end
return {id, values}
"""


def _glob_escape(text: str) -> str:
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)


class RedisStore(Store):
    """A key-value store with torch's ``Store`` semantics, kept in Redis.

    Args:
        client: A redis-py client (``decode_responses`` off).
        prefix: The prefix of every key of this store, e.g. ``"rdzv:job:store:"``.
        timeout: The timeout of blocking operations.
        owns_client: Close the client in :meth:`close`.

    Raises:
        ValueError: The prefix is empty.
    """

    def __init__(
        self,
        client: redis.Redis,
        prefix: str,
        timeout: Timeout = DEFAULT_STORE_TIMEOUT,
        owns_client: bool = False,
    ) -> None:
        super().__init__(timeout)
        if not prefix:
            raise ValueError("the Redis store prefix must not be empty")
        self._client = client
        self._owns_client = owns_client
        self._endpoint = endpoint_of(client)
        self._keys = f"{prefix}k:"
        self._queues = f"{prefix}q:"
        self._events = f"{prefix}events"
        self._set = client.register_script(_SET)
        self._add = client.register_script(_ADD)
        self._append = client.register_script(_APPEND)
        self._delete = client.register_script(_DELETE)
        self._compare_set = client.register_script(_COMPARE_SET)
        self._read = client.register_script(_READ)

    @property
    def supports_watch(self) -> bool:
        """True: waits block on the server's change stream."""
        return True

    def _k(self, key: str) -> str:
        return self._keys + key

    def _q(self, key: str) -> str:
        return self._queues + key

    def _run(self, script: Any, keys: list[str], args: list[Any], what: str) -> Any:
        with redis_errors(self._endpoint, what):
            return script(keys=[*keys, self._events], args=[*args, _STREAM_MAXLEN])

    def _read_keys(self, keys: Sequence[str]) -> tuple[bytes, list[bytes | None]]:
        with redis_errors(self._endpoint, "reading keys"):
            last_id, values = self._read(keys=[*(self._k(k) for k in keys), self._events])
        return as_bytes(last_id), [as_bytes(v[1]) if int(v[0]) else None for v in values]

    def _until(
        self, ready: Callable[[list[bytes | None]], _T | None], keys: Sequence[str], timeout: float
    ) -> _T:
        deadline = Deadline.after(timeout, current_clock())
        while True:
            last_id, values = self._read_keys(keys)
            result = ready(values)
            if result is not None:
                return result
            if not self._block(last_id, deadline):
                raise StoreTimeoutError(
                    f"timed out after {timeout:g} s waiting for keys {list(keys)!r}"
                )

    def _block(self, last_id: bytes, deadline: Deadline) -> bool:
        return block_on_stream(self._client, self._endpoint, self._events, last_id, deadline)

    def set(self, key: str, value: Value) -> None:  # noqa: D102 - documented on Store
        self._run(self._set, [self._k(key)], [to_bytes(value)], f"setting key {key!r}")

    def get(self, key: str) -> bytes:  # noqa: D102
        return self._until(lambda values: values[0], [key], self.timeout.total_seconds())

    def add(self, key: str, amount: int) -> int:  # noqa: D102
        try:
            return int(self._run(self._add, [self._k(key)], [int(amount)], f"adding to {key!r}"))
        except RendezvousStateError as exc:
            if "not an integer" in str(exc):
                raise ValueError(f"the value of key {key!r} is not an integer") from exc
            raise

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:  # noqa: D102
        result = self._run(
            self._compare_set,
            [self._k(key)],
            [to_bytes(expected), to_bytes(desired)],
            f"compare-and-set of {key!r}",
        )
        return as_bytes(result)

    def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None:  # noqa: D102
        seconds = self.timeout.total_seconds() if timeout is None else to_seconds(timeout)
        self._until(
            lambda values: True if all(v is not None for v in values) else None, keys, seconds
        )

    def check(self, keys: Sequence[str]) -> bool:  # noqa: D102
        _, values = self._read_keys(keys)
        return all(v is not None for v in values)

    def try_multi_get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Return the values of several keys in one script call; None for a missing key."""
        if not keys:
            return []
        return self._read_keys(keys)[1]

    def delete_key(self, key: str) -> bool:  # noqa: D102
        return int(self._run(self._delete, [self._k(key)], [], f"deleting {key!r}")) > 0

    def _scan(self) -> list[str]:
        pattern = _glob_escape(self._keys) + "*"
        with redis_errors(self._endpoint, "listing keys"):
            names = list(self._client.scan_iter(match=pattern, count=1000))
        return [as_bytes(name).decode("utf-8", "replace")[len(self._keys) :] for name in names]

    def num_keys(self) -> int:  # noqa: D102
        return len(self._scan())

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:  # noqa: D102
        def ready(values: list[bytes | None]) -> list[bytes] | None:
            if any(v is None for v in values):
                return None
            return [v for v in values if v is not None]

        return self._until(ready, keys, self.timeout.total_seconds())

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:  # noqa: D102
        check_multi_set(keys, values)
        if not keys:
            return
        self._run(self._set, [self._k(k) for k in keys], [to_bytes(v) for v in values], "multi_set")

    def append(self, key: str, value: Value) -> None:  # noqa: D102
        self._run(self._append, [self._k(key)], [to_bytes(value)], f"appending to {key!r}")

    def list_keys(self) -> list[str]:  # noqa: D102
        return self._scan()

    def queue_push(self, key: str, value: Value) -> None:  # noqa: D102
        with redis_errors(self._endpoint, f"pushing onto queue {key!r}"):
            self._client.rpush(self._q(key), to_bytes(value))

    def queue_pop(self, key: str, block: bool = True) -> bytes:  # noqa: D102
        name = self._q(key)
        timeout = self.timeout.total_seconds() if block else 0.0
        deadline = Deadline.after(timeout, current_clock())
        while True:
            with redis_errors(self._endpoint, f"popping queue {key!r}"):
                item = self._client.lpop(name)
            if item is not None:
                return as_bytes(item)
            remaining = deadline.left()
            if remaining <= 0:
                raise StoreTimeoutError(
                    f"timed out after {timeout:g} s waiting for an item in queue {key!r}"
                )
            wait = max(0.001, min(remaining, MAX_BLOCK_SECONDS))
            with deadline.clock.blocking(wait), redis_errors(self._endpoint, f"popping {key!r}"):
                popped = self._client.blpop([name], timeout=wait)
            if popped is not None:
                return as_bytes(popped[1])

    def queue_len(self, key: str) -> int:  # noqa: D102
        with redis_errors(self._endpoint, f"reading the length of queue {key!r}"):
            return int(self._client.llen(self._q(key)))

    def watch(self, key: str, previous: bytes | None, timeout: Timeout) -> bytes | None:  # noqa: D102
        deadline = Deadline.after(to_seconds(timeout), current_clock())
        while True:
            last_id, values = self._read_keys([key])
            if values[0] != previous:
                return values[0]
            if not self._block(last_id, deadline):
                return previous

    def close(self) -> None:
        """Close the client if this store owns it."""
        if self._owns_client:
            self._client.close()
