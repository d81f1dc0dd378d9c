"""The Redis rendezvous backend (extra ``rdzv[redis]``, needs redis-py).

Theory of operation
-------------------
A run keeps its state in one hash, ``<key_prefix><run_id>``, with fields
``v`` (the state) and ``rev`` (the fencing token, a decimal integer).
Compare-and-set is one Lua script: it checks the type and fields of the hash
(anything else is a corrupt record), compares ``rev``, writes the new value
with ``rev + 1`` and appends the new revision to a change stream,
``<key>:events``, all atomically; on a stale token it returns the current
value and revision in the same round trip. A new record starts its ``rev``
at the server's clock in microseconds, so a run whose state expired and was
created again never hands out a token it handed out before. A read names the
last token it saw, and the script leaves the value out while the stored
``rev`` is still that one, so polling an unchanged state costs O(1) bytes
whatever the number of participants.

Waiting for a change reads the state and the stream's last entry id in one
script, then blocks in ``XREAD BLOCK`` from that id: a write in between is
never missed and a reader that reconnects resumes from its id (pub/sub
would lose messages while reconnecting).

Seats (:class:`~rdzv.backends.base.SeatedBackend`): a seated write passes
every member's seat to the same script, which stores each, after the
compare-and-set won, under ``<key>:seat:<node>`` as ``<new rev>:<seat>``
with the state's TTL; a member reads its own with one ``GET`` and takes it
only when it names the revision it saw. A waiting member reads the
revision alone (one script: the type, the revision and the stream's last
id), so a seal costs each member O(1) bytes.

A sealed round's verdict (:class:`~rdzv.backends.base.VerdictBackend`)
is a key, ``<key>:verdict:<round>``, whose script also appends to the
state's change stream: a member waiting to confirm blocks on that one
stream for the verdict and for a write of the state, and reads nothing
until one of them comes.

Join queues (``<key>:queue:<round>``) and the members' confirmations of a
sealed round (``<key>:confirm:<round>``) are lists (``RPUSH`` returns the
position) with a stream each for blocking waits; heartbeats are per-node counters with a ``PX`` TTL
(``INCR`` + ``PEXPIRE``), so a dead node's key expires on the server; a
counter that is not an integer (written by something else) is reset to 1 by
the next beat, so a poisoned key never stops its owner's heartbeats.

Redis replication is asynchronous. Run one primary: after a failover to a
replica an acknowledged write can be lost and the token can go backwards.
Redis Cluster is not supported (a run's keys are not hash-tagged together).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rdzv.backends.base import (
    LivenessBackend,
    NamedQueues,
    RendezvousBackend,
    SeatedBackend,
    Token,
    VerdictBackend,
    WatchableBackend,
    revision_token,
    validate_node_key,
    validate_record,
    validate_seats,
)
from rdzv.backends.options import RedisOptions, check_key_settings
from rdzv.backends.redis.connection import (
    as_bytes,
    block_on_stream,
    create_client,
    endpoint_of,
    redis_errors,
)
from rdzv.backends.redis.store import RedisStore
from rdzv.endpoint import format_endpoint
from rdzv.errors import RendezvousConnectionError, RendezvousStateError
from rdzv.retry import Clock, Deadline, as_clock, current_clock

if TYPE_CHECKING:
    import redis

    from rdzv.api import RendezvousParameters


DEFAULT_KEY_PREFIX = RedisOptions.DEFAULT_PREFIX
_REDIS_FAILED = "The connection to Redis has failed. See inner exception for details."

_STREAM_MAXLEN = "100"

_CAS = """
local kind = redis.call('TYPE', KEYS[1]).ok
if kind ~= 'none' and kind ~= 'hash' then return {-1, kind} end
local v, rev = false, false
if kind == 'hash' then
  local cur = redis.call('HMGET', KEYS[1], 'v', 'rev')
  v, rev = cur[1], cur[2]
  if v == false or rev == false or tonumber(rev) == nil then return {-2} end
  if rev ~= ARGV[1] then return {2, v, rev} end
elseif ARGV[1] ~= '0' then
  return {0}
end
local new
if rev then
  new = string.format('%.0f', tonumber(rev) + 1)
else
  local t = redis.call('TIME')
  new = string.format('%.0f', tonumber(t[1]) * 1000000 + tonumber(t[2]))
end
redis.call('HSET', KEYS[1], 'v', ARGV[2], 'rev', new)
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', 'rev', new)
redis.call('PEXPIRE', KEYS[2], ARGV[3])
for i = 3, #KEYS do
  redis.call('SET', KEYS[i], new .. ':' .. ARGV[i + 2], 'PX', ARGV[3])
end
return {1, new}
"""

# Each read script starts by reading the id of the last entry of the change
# stream KEYS[2]: a caller that then blocks on the stream from it misses no write.
_LAST_ID = """
local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
local id = '0-0'
if #last > 0 then id = last[1][1] end
"""

_READ = (
    _LAST_ID
    + """
local kind = redis.call('TYPE', KEYS[1]).ok
if kind == 'none' then return {0, id} end
if kind ~= 'hash' then return {-1, id, kind} end
local rev = redis.call('HGET', KEYS[1], 'rev')
if ARGV[2] == 'rev' then
  if rev == false or tonumber(rev) == nil or redis.call('HEXISTS', KEYS[1], 'v') == 0 then
    return {-2, id}
  end
  return {2, id, rev}
end
if ARGV[1] ~= '' and rev == ARGV[1] and redis.call('HEXISTS', KEYS[1], 'v') == 1 then
  return {2, id, rev}
end
local cur = redis.call('HMGET', KEYS[1], 'v', 'rev')
if cur[1] == false or cur[2] == false or tonumber(cur[2]) == nil then return {-2, id} end
return {1, id, cur[1], cur[2]}
"""
)

_ENQUEUE = """
local n = redis.call('RPUSH', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'n', n)
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return n
"""

_QUEUE_LEN = (
    _LAST_ID
    + """
return {redis.call('LLEN', KEYS[1]), id}
"""
)

_VERDICT = (
    _LAST_ID
    + """
local rev = ''
if redis.call('TYPE', KEYS[1]).ok == 'hash' then rev = redis.call('HGET', KEYS[1], 'rev') or '' end
return {redis.call('EXISTS', KEYS[3]), id, rev}
"""
)

_SET_VERDICT = """
redis.call('SET', KEYS[1], '1', 'PX', ARGV[1])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', 'verdict', ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[1])
"""

_BEAT = """
local n = redis.pcall('INCR', KEYS[1])
if type(n) == 'table' and n.err then
  redis.call('SET', KEYS[1], '1')
  n = 1
end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return n
"""


def _token(value: Any) -> int:
    return int(as_bytes(value))


class RedisRendezvousBackend(
    RendezvousBackend,
    WatchableBackend,
    SeatedBackend,
    NamedQueues,
    VerdictBackend,
    LivenessBackend,
):
    """Keeps a run's rendezvous state in Redis, with compare-and-set in one Lua script.

    Args:
        client: A redis-py client (``decode_responses`` must be off).
        run_id: The run identifier.
        key_prefix: Prefix of every key of this backend (``rdzv:``).
        ttl: Seconds an unwritten state survives on the server (two hours).
        liveness_ttl: Seconds a heartbeat key survives without a beat (60).
        owns_client: Close ``client`` in :meth:`close`.
        clock: The clock of its waits when the caller names none; real time
            when None.

    Raises:
        ValueError: An empty run id or prefix, a TTL below 1 second, or a
            client that decodes responses.
    """

    def __init__(
        self,
        client: redis.Redis,
        run_id: str,
        key_prefix: str | None = None,
        ttl: int | None = None,
        liveness_ttl: int | None = None,
        *,
        owns_client: bool = False,
        clock: Clock | Callable[[], float] | None = None,
    ) -> None:
        prefix, ttl, liveness_ttl = check_key_settings(
            "Redis", run_id, key_prefix, DEFAULT_KEY_PREFIX, ttl, liveness_ttl
        )
        if client.connection_pool.connection_kwargs.get("decode_responses"):
            raise ValueError("the Redis client must not decode responses (decode_responses=False)")
        self._client = client
        self._owns_client = owns_client
        self._clock = as_clock(clock)
        self._endpoint = endpoint_of(client)
        self._key = f"{prefix}{run_id}"
        self._events = f"{self._key}:events"
        self._ttl_ms = ttl * 1000
        self._liveness_ms = liveness_ttl * 1000
        self._cas = client.register_script(_CAS)
        self._read = client.register_script(_READ)
        # The last state read or written, with its token: the read script
        # leaves the value out when the stored token is still this one.
        self._last: tuple[bytes, int] | None = None
        self._enqueue = client.register_script(_ENQUEUE)
        self._queue_len = client.register_script(_QUEUE_LEN)
        self._beat = client.register_script(_BEAT)
        self._verdict = client.register_script(_VERDICT)
        self._set_verdict = client.register_script(_SET_VERDICT)

    @property
    def name(self) -> str:
        """``redis``."""
        return "redis"

    @property
    def client(self) -> redis.Redis:
        """The redis-py client."""
        return self._client

    def close(self) -> None:
        """Close the client if this backend owns it (built by ``create_backend``)."""
        if self._owns_client:
            self._client.close()

    @property
    def key(self) -> str:
        """The key of the state hash."""
        return self._key

    @property
    def endpoint(self) -> str:
        """``host:port`` of the server."""
        return self._endpoint

    def _corrupt(self, detail: str) -> RendezvousStateError:
        return RendezvousStateError(
            f"the Redis key {self._key!r} at {self._endpoint} is not an rdzv rendezvous state "
            f"({detail}); delete the key or use another run id"
        )

    def _read_state(self) -> tuple[tuple[bytes, Token] | None, bytes]:
        last = self._last
        with redis_errors(self._endpoint, "reading the rendezvous state"):
            reply = self._read(
                keys=[self._key, self._events], args=["" if last is None else str(last[1]), ""]
            )
        code = self._read_code(reply)
        last_id = as_bytes(reply[1])
        if code == 0:
            return None, last_id
        if code == 2 and last is not None:
            # Only sent when the stored rev is the one named: last's token.
            return last, last_id
        found = (as_bytes(reply[2]), _token(reply[3]))
        self._last = found
        return found, last_id

    def _get(self, key: str, what: str) -> bytes | None:
        """``GET`` one key; None when it is absent."""
        with redis_errors(self._endpoint, what):
            value = self._client.get(key)
        return None if value is None else as_bytes(value)

    def _read_code(self, reply: Any, kind_at: int = 2) -> int:
        """Return a script's code; raise for a corrupt record (-1: its type at ``kind_at``; -2)."""
        code = int(reply[0])
        if code == -1:
            raise self._corrupt(f"it is a {as_bytes(reply[kind_at]).decode()}, not a hash")
        if code == -2:
            raise self._corrupt("its fields v and rev are missing or rev is not an integer")
        return code

    def get_state(self) -> tuple[bytes, Token] | None:
        """Read the state (see :class:`RendezvousBackend`)."""
        return self._read_state()[0]

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        """Write the state if ``token`` is current (see :class:`RendezvousBackend`)."""
        return self.set_state_seated(state, token, {})

    def set_state_seated(
        self, state: bytes, token: Token | None, seats: Mapping[str, bytes]
    ) -> tuple[bytes, Token, bool] | None:
        """Write the state and, when the write wins, the members' seats, in one script."""
        validate_seats(seats)
        seat_keys = [self._seat_key(node) for node in seats]
        state = bytes(state)
        expected = revision_token(token)
        if expected is None:
            current = self.get_state()
            return None if current is None else (current[0], current[1], False)
        with redis_errors(self._endpoint, "writing the rendezvous state"):
            reply = self._cas(
                keys=[self._key, self._events, *seat_keys],
                args=[str(expected), state, self._ttl_ms, _STREAM_MAXLEN, *seats.values()],
            )
        code = self._read_code(reply, kind_at=1)
        if code == 1:
            self._last = (state, _token(reply[1]))
            return state, self._last[1], True
        if code == 0:
            return None
        return as_bytes(reply[1]), _token(reply[2]), False

    def _seat_key(self, node: str) -> str:
        """The key of ``node``'s seat; the caller validated ``node``."""
        return f"{self._key}:seat:{node}"

    def _read_rev(self) -> tuple[int | None, bytes]:
        """Return the stored revision (None when nothing is stored) and the stream's last id."""
        with redis_errors(self._endpoint, "reading the rendezvous token"):
            reply = self._read(keys=[self._key, self._events], args=["", "rev"])
        code = self._read_code(reply)
        return (None if code == 0 else _token(reply[2])), as_bytes(reply[1])

    def read_token(self) -> Token | None:
        """Return the stored revision without the state (see :class:`SeatedBackend`)."""
        return self._read_rev()[0]

    def wait_for_token(self, token: Token | None, timeout: float) -> Token | None:
        """Wait as :meth:`wait_for_state`, reading the revision alone."""
        current, last_id = self._read_rev()
        if current != token or not self._block(self._events, last_id, timeout):
            return current
        return self._read_rev()[0]

    def read_seat(self, token: Token, node: str) -> bytes | None:
        """Return the seat the write of ``token`` stored for ``node`` (one ``GET``)."""
        value = self._get(self._seat_key(validate_node_key(node)), "reading a seat")
        if value is None or isinstance(token, bool) or not isinstance(token, int):
            return None
        head, _, seat = value.partition(b":")
        return seat if head == str(token).encode() and seat else None

    def _block(self, stream: str, last_id: bytes, timeout: float) -> bool:
        """Block until ``stream`` has an entry after ``last_id``; False once ``timeout`` passed."""
        return block_on_stream(self._client, self._endpoint, stream, last_id, self._within(timeout))

    def _within(self, timeout: float) -> Deadline:
        """Return ``timeout`` from now on the caller's clock (this backend's when it names none)."""
        return Deadline.after(timeout, current_clock(self._clock))

    def wait_for_state(self, token: Token | None, timeout: float) -> tuple[bytes, Token] | None:
        """Wait until the state's token differs from ``token``, blocking on the change stream."""
        current, last_id = self._read_state()
        if (None if current is None else current[1]) != token or not self._block(
            self._events, last_id, timeout
        ):
            return current
        return self.get_state()

    # -- join queue -----------------------------------------------------------

    def _queue_keys(self, round_id: int) -> list[str]:
        base = f"{self._key}:{self._queue_name}:{round_id}"
        return [base, f"{base}:events"]

    def enqueue(self, round_id: int, record: bytes) -> int:
        """Append a join record to the queue of ``round_id`` (``RPUSH``)."""
        validate_record(round_id, record)
        with redis_errors(self._endpoint, "enqueueing a join record"):
            return int(
                self._enqueue(
                    keys=self._queue_keys(round_id), args=[record, self._ttl_ms, _STREAM_MAXLEN]
                )
            )

    def queue_records(self, round_id: int) -> list[bytes]:
        """Return the join records of ``round_id`` in position order."""
        with redis_errors(self._endpoint, "reading a join queue"):
            items = self._client.lrange(self._queue_keys(round_id)[0], 0, -1)
        return [as_bytes(item) for item in items]

    def queue_length(self, round_id: int) -> int:
        """Return how many join records ``round_id`` has."""
        with redis_errors(self._endpoint, "reading a join queue length"):
            return int(self._client.llen(self._queue_keys(round_id)[0]))

    def wait_queue_length(self, round_id: int, known: int, timeout: float) -> int:
        """Wait until the queue length of ``round_id`` differs from ``known``."""
        keys = self._queue_keys(round_id)
        with redis_errors(self._endpoint, "reading a join queue length"):
            length, last_id = self._queue_len(keys=keys)
        if int(length) != known or not self._block(keys[1], as_bytes(last_id), timeout):
            return int(length)
        return self.queue_length(round_id)

    def drop_queue(self, round_id: int) -> None:
        """Delete the queue of ``round_id``."""
        with redis_errors(self._endpoint, "deleting a join queue"):
            self._client.delete(*self._queue_keys(round_id))

    # -- verdicts -------------------------------------------------------------

    def _verdict_key(self, round_id: int) -> str:
        return f"{self._key}:verdict:{round_id}"

    def set_verdict(self, round_id: int) -> None:
        """Store the verdict of ``round_id`` and wake the state's waiters (one script)."""
        with redis_errors(self._endpoint, "writing a round's verdict"):
            self._set_verdict(
                keys=[self._verdict_key(round_id), self._events],
                args=[self._ttl_ms, _STREAM_MAXLEN, round_id],
            )

    def wait_for_verdict(self, round_id: int, token: Token, timeout: float) -> bool | None:
        """Block on the state's change stream, which the verdict also writes; see :class:`VerdictBackend`."""
        keys = [self._key, self._events, self._verdict_key(round_id)]
        deadline = self._within(timeout)
        events = self._events
        while True:
            with redis_errors(self._endpoint, "reading a round's verdict"):
                verdict, last_id, rev = self._verdict(keys=keys)
            if int(verdict):
                return True
            if as_bytes(rev) != str(token).encode():
                return False
            if not block_on_stream(
                self._client, self._endpoint, events, as_bytes(last_id), deadline
            ):
                return None

    def drop_verdict(self, round_id: int) -> None:
        """Delete the verdict of ``round_id``."""
        with redis_errors(self._endpoint, "deleting a round's verdict"):
            self._client.delete(self._verdict_key(round_id))

    # -- liveness ---------------------------------------------------------------

    def _alive_key(self, node: str) -> str:
        validate_node_key(node)
        return f"{self._key}:alive:{node}"

    def beat(self, node: str) -> None:
        """Record a heartbeat: ``INCR`` the node's key and reset its ``PX`` TTL."""
        key = self._alive_key(node)
        with redis_errors(self._endpoint, "recording a heartbeat"):
            self._beat(keys=[key], args=[self._liveness_ms])

    def heartbeat_mark(self, node: str) -> bytes | None:
        """Return the node's heartbeat counter, or None once it expired."""
        return self._get(self._alive_key(node), "reading a heartbeat")

    def heartbeat_marks(self, nodes: Sequence[str]) -> dict[str, bytes | None]:
        """Return the heartbeat counters of several nodes in one ``MGET``."""
        if not nodes:
            return {}
        keys = [self._alive_key(node) for node in nodes]
        with redis_errors(self._endpoint, "reading heartbeats"):
            values = self._client.mget(keys)
        return {
            node: None if value is None else as_bytes(value)
            for node, value in zip(nodes, values, strict=True)
        }

    def forget(self, node: str) -> None:
        """Delete the node's heartbeat key and its seat."""
        keys = [self._alive_key(node), self._seat_key(node)]
        with redis_errors(self._endpoint, "deleting a heartbeat"):
            self._client.delete(*keys)


def open_redis(options: RedisOptions) -> tuple[RedisRendezvousBackend, RedisStore]:
    """Build the Redis backend and the Redis store of a run from parsed options.

    Raises:
        RendezvousConnectionError: Redis did not answer a ``PING`` (one
            bounded round trip: the connect timeout, redis-py's three
            retries); the message starts as torch's etcd backend's does.
    """
    client = create_client(options)
    endpoint = format_endpoint(options.host, options.port)
    try:
        with redis_errors(endpoint, "checking that it is reachable (PING)"):
            client.ping()
    except RendezvousConnectionError as exc:
        client.close()
        raise RendezvousConnectionError(f"{_REDIS_FAILED} {exc}") from exc
    except BaseException:
        client.close()
        raise
    backend = RedisRendezvousBackend(
        client,
        options.run_id,
        key_prefix=options.keys.key_prefix,
        ttl=options.keys.ttl,
        owns_client=True,
    )
    store = RedisStore(client, f"{backend.key}:store:")
    return backend, store


def create_backend(params: RendezvousParameters) -> tuple[RedisRendezvousBackend, RedisStore]:
    """Build the Redis backend and the Redis store of a run.

    Options: see :meth:`rdzv.backends.options.RedisOptions.from_params`.

    Raises:
        ValueError: An option or the endpoint is invalid; the message names it.
        RendezvousConnectionError: Redis is unreachable (one bounded ``PING``).
    """
    return open_redis(RedisOptions.from_params(params))
