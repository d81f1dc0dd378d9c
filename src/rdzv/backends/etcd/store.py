"""A :class:`rdzv.Store` kept in etcd v3.

Theory of operation
-------------------
Keys live under ``<prefix>k/<key>``; queue items under ``<prefix>q/<name>/``
with a unique suffix and are popped oldest-created first. Reads that must
wait (``get``, ``wait``, ``watch``, a blocking ``queue_pop``) read once,
then watch from the revision after that read, so a write in between is
never missed, and give up at the deadline. A watch event carries the value
it put: ``get`` and ``watch`` of one key take it from there, the others
re-read after every batch of events. Read-modify-write operations (``add``, ``append``,
``compare_set``) are compare-and-set loops on the key's ``mod_revision``;
``multi_set`` is one transaction; a pop deletes the oldest item in a
transaction that checks it still exists, so two consumers never get the
same item.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import TypeVar

from rdzv.backends.etcd.client import EtcdClientBase
from rdzv.backends.etcd.gateway_codec import (
    EtcdCompactedError,
    KeyValue,
    WatchEvent,
    delete_request,
    mod_revision_compare,
    put_request,
    range_request,
)
from rdzv.errors import RendezvousConnectionError, StoreTimeoutError
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

__all__ = ["EtcdStore"]

_T = TypeVar("_T")
# Compare-and-set retries before giving up (each retry means another writer won).
_MAX_CAS_ATTEMPTS = 10_000


def _value(kv: KeyValue | None) -> bytes | None:
    return None if kv is None else kv.value


def _last_value(events: list[WatchEvent]) -> bytes | None:
    """Return the value the newest of a key's events put (None if it deleted the key, or none came)."""
    if not events or events[-1].kind == "DELETE":
        return None
    return events[-1].kv.value


class EtcdStore(Store):
    """A key-value store with torch's ``Store`` semantics, kept in etcd.

    Args:
        client: The etcd client (either one).
        prefix: The key prefix of this store (bytes or str), e.g.
            ``b"/rdzv/job/store/"``.
        timeout: The timeout of blocking operations.
        owns_client: Close the client in :meth:`close` (False when the client
            is shared with a backend).

    Raises:
        ValueError: The prefix is empty.
    """

    def __init__(
        self,
        client: EtcdClientBase,
        prefix: bytes | str,
        timeout: Timeout = DEFAULT_STORE_TIMEOUT,
        owns_client: bool = False,
    ) -> None:
        super().__init__(timeout)
        prefix_b = prefix.encode() if isinstance(prefix, str) else bytes(prefix)
        if not prefix_b:
            raise ValueError("the etcd store prefix must not be empty")
        self._client = client
        self._owns_client = owns_client
        self._keys = prefix_b + b"k/"
        self._queues = prefix_b + b"q/"

    @property
    def supports_watch(self) -> bool:
        """True: etcd watches keys on the server."""
        return True

    def _k(self, key: str) -> bytes:
        return self._keys + key.encode("utf-8")

    def _q(self, name: str) -> bytes:
        return self._queues + name.encode("utf-8") + b"/"

    def _until(
        self,
        read: Callable[[], tuple[_T | None, int]],
        watch_key: bytes,
        prefix: bool,
        timeout: float,
        what: str,
        seen: Callable[[list[WatchEvent]], _T | None] = lambda events: None,
    ) -> _T:
        """Read until ``read`` finds a result, watching for changes in between.

        ``seen`` may find the result in a watch's events (a put's value), which
        spares the read after the watch.
        """
        deadline = Deadline.after(timeout, current_clock())
        while True:
            result, revision = read()
            if result is not None:
                return result
            try:
                watched = self._client.watch_within(watch_key, revision + 1, deadline, prefix)
            except EtcdCompactedError:
                continue
            if watched is None:
                raise StoreTimeoutError(f"timed out after {timeout:g} s waiting for {what}")
            result = seen(watched[0])
            if result is not None:
                return result

    def set(self, key: str, value: Value) -> None:  # noqa: D102 - documented on Store
        self._client.put(self._k(key), to_bytes(value))

    def get(self, key: str) -> bytes:  # noqa: D102
        full = self._k(key)

        def read() -> tuple[bytes | None, int]:
            kv, revision = self._client.get(full)
            return (None if kv is None else kv.value), revision

        return self._until(
            read, full, False, self.timeout.total_seconds(), f"key {key!r}", _last_value
        )

    def _cas_loop(self, key: str, change: Callable[[bytes | None], bytes | None]) -> bytes | None:
        """Apply ``change`` to the stored value until a compare-and-set wins.

        ``change`` returns the value to write, or None to write nothing.
        Returns the value stored afterwards.
        """
        full = self._k(key)
        kv, _ = self._client.get(full)
        for _ in range(_MAX_CAS_ATTEMPTS):
            current = None if kv is None else kv.value
            desired = change(current)
            if desired is None:
                return current
            written, _, now, attempts = self._client.compare_and_put(
                full, desired, 0 if kv is None else kv.mod_revision
            )
            if written:
                return desired
            if attempts > 1 and now is not None and now.value == desired:
                # The reply to our first try was lost and the retry found our write.
                return desired
            kv = now
        raise RendezvousConnectionError(
            f"gave up updating etcd key {full!r} after {_MAX_CAS_ATTEMPTS} conflicting writes"
        )

    def add(self, key: str, amount: int) -> int:  # noqa: D102
        def change(current: bytes | None) -> bytes:
            try:
                value = int(current if current is not None else b"0") + int(amount)
            except ValueError:
                raise ValueError(
                    f"the value of key {key!r} is not an integer: {current!r}"
                ) from None
            return str(value).encode()

        result = self._cas_loop(key, change)
        assert result is not None
        return int(result)

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:  # noqa: D102
        expected_b, desired_b = to_bytes(expected), to_bytes(desired)

        def change(current: bytes | None) -> bytes | None:
            if current is None:
                return None if expected_b else desired_b
            return desired_b if current == expected_b else None

        result = self._cas_loop(key, change)
        return expected_b if result is None else result

    def _missing(self, keys: Sequence[str]) -> tuple[list[str], list[KeyValue | None], int]:
        if not keys:
            return [], [], 0
        result = self._client.txn(
            [], [{"request_range": range_request(self._k(k))} for k in keys], []
        )
        found: list[KeyValue | None] = []
        for i in range(len(keys)):
            kvs = self._client.txn_kvs(result, i)
            found.append(kvs[0] if kvs else None)
        missing = [k for k, kv in zip(keys, found, strict=True) if kv is None]
        return missing, found, result.revision

    def _wait_all(self, keys: Sequence[str], timeout: float) -> list[bytes]:
        keys = list(keys)

        def read() -> tuple[list[bytes] | None, int]:
            missing, found, revision = self._missing(keys)
            if missing:
                return None, revision
            return [kv.value for kv in found if kv is not None], revision

        return self._until(read, self._keys, True, timeout, f"keys {keys!r}")

    def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None:  # noqa: D102
        seconds = self.timeout.total_seconds() if timeout is None else to_seconds(timeout)
        self._wait_all(keys, seconds)

    def check(self, keys: Sequence[str]) -> bool:  # noqa: D102
        missing, _, _ = self._missing(list(keys))
        return not missing

    def try_multi_get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Return the values of several keys in one transaction; None for a missing key."""
        _, found, _ = self._missing(list(keys))
        return [None if kv is None else kv.value for kv in found]

    def delete_key(self, key: str) -> bool:  # noqa: D102
        return self._client.delete(self._k(key)) > 0

    def num_keys(self) -> int:  # noqa: D102
        return self._client.count(self._keys)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:  # noqa: D102
        return self._wait_all(keys, self.timeout.total_seconds())

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:  # noqa: D102
        check_multi_set(keys, values)
        if not keys:
            return
        puts = [
            {"request_put": put_request(self._k(k), to_bytes(v))}
            for k, v in zip(keys, values, strict=True)
        ]
        self._client.txn([], puts, [])

    def append(self, key: str, value: Value) -> None:  # noqa: D102
        data = to_bytes(value)
        self._cas_loop(key, lambda current: (current or b"") + data)

    def list_keys(self) -> list[str]:  # noqa: D102
        kvs, _ = self._client.range(self._keys, prefix=True, keys_only=True)
        return [kv.key[len(self._keys) :].decode("utf-8", "replace") for kv in kvs]

    def queue_push(self, key: str, value: Value) -> None:  # noqa: D102
        self._client.put(self._q(key) + uuid.uuid4().hex.encode(), to_bytes(value))

    def queue_pop(self, key: str, block: bool = True) -> bytes:  # noqa: D102
        prefix = self._q(key)

        def pop() -> tuple[bytes | None, int]:
            for _ in range(_MAX_CAS_ATTEMPTS):
                kvs, revision = self._client.range(
                    prefix, prefix=True, limit=1, sort_by_create=True
                )
                if not kvs:
                    return None, revision
                item = kvs[0]
                result = self._client.txn(
                    [mod_revision_compare(item.key, item.mod_revision)],
                    [{"request_delete_range": delete_request(item.key)}],
                    [],
                )
                if result.succeeded:
                    return item.value, result.revision
            raise RendezvousConnectionError(
                f"gave up popping etcd queue {key!r} after {_MAX_CAS_ATTEMPTS} conflicts"
            )

        timeout = self.timeout.total_seconds() if block else 0.0
        return self._until(pop, prefix, True, timeout, f"an item in queue {key!r}")

    def queue_len(self, key: str) -> int:  # noqa: D102
        return self._client.count(self._q(key))

    def watch(self, key: str, previous: bytes | None, timeout: Timeout) -> bytes | None:  # noqa: D102
        deadline = Deadline.after(to_seconds(timeout), current_clock())
        return self._client.watch_value(self._k(key), previous, _value, deadline)

    def close(self) -> None:
        """Close the etcd client if this store owns it."""
        if self._owns_client:
            self._client.close()
