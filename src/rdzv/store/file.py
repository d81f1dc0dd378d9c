"""A store kept in one file, readable and writable by torch's ``FileStore``.

Theory of operation
-------------------
The file is an append-only log of records. A record is a key and a value,
each written as its length (32 bits, in the machine's byte order) followed by
its bytes. Replaying the log from the start gives the store's contents:

* key ``/k``: the user key ``k`` now holds the value (``set``, ``add``,
  ``compare_set`` and ``append`` all write the whole new value);
* key ``-/k`` with an empty value: ``k`` was deleted;
* any other key is bookkeeping, not a user key: torch's ``refcount/`` and
  ``cleanup/`` counters, and rdzv's queues under ``q/``.

Every operation opens the file, takes ``flock(2)`` on it (shared to read,
exclusive to write), reads the records appended since this store's last
visit into its cache, and a write appends its record; closing the file drops
the lock. That is torch's ``FileStore`` protocol (torch 2.13), so rdzv and
torch processes sharing the file see each other's keys and their writes
exclude each other. The file lives on a local or shared filesystem with
working ``flock`` (Linux NFS emulates it with POSIX locks); this module needs
POSIX.

Blocking calls (``get``, ``wait``, ``watch``, ``queue_pop``) poll: they
``stat`` the file and read it again only when its size or inode changed. The
pause between polls starts at :data:`POLL_FIRST` and doubles up to
:data:`POLL_MAX`, so a change is seen within about 50 ms (torch polls every
10 ms). Waiting for the lock polls the same way and gives up at the store
timeout, so a process stopped while holding the lock cannot hang the others.

The log is never compacted: a run's file grows with every write (a heartbeat
is one record of about 60 bytes), and a new process reads it whole once.

Users are counted as torch counts them: opening adds 1 to ``refcount/``;
:meth:`FileStore.close` adds 1 to ``cleanup/`` and -1 to ``refcount/``, and
when ``world_size`` is not negative, the last user to close (``refcount/``
back to 0, ``cleanup/`` at least ``world_size``) removes the file.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from rdzv.errors import RendezvousConnectionError, RendezvousStateError, StoreTimeoutError
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

__all__ = ["POLL_FIRST", "POLL_MAX", "FileStore"]

_T = TypeVar("_T")

POLL_FIRST = 0.002
"""Seconds of the first pause of a blocking call that polls the file."""

POLL_MAX = 0.05
"""The longest pause between two polls, in seconds: the latency of a change."""

_LENGTH = struct.Struct("=I")  # torch writes a uint32_t in the machine's byte order
_MAX_FIELD = (1 << 32) - 1
_USER = b"/"
_DELETED = b"-"
_REFCOUNT = b"refcount/"
_CLEANUP = b"cleanup/"
_QUEUE = b"q/"


def _record(key: bytes, value: bytes) -> bytes:
    if len(key) > _MAX_FIELD or len(value) > _MAX_FIELD:
        raise ValueError(
            f"a file store key or value is limited to {_MAX_FIELD} bytes, "
            f"got {max(len(key), len(value))}"
        )
    return _LENGTH.pack(len(key)) + key + _LENGTH.pack(len(value)) + value


def _frame_items(items: Sequence[bytes]) -> bytes:
    return b"".join(_LENGTH.pack(len(item)) + item for item in items)


def _unframe_items(data: bytes, what: str) -> list[bytes]:
    items: list[bytes] = []
    offset = 0
    while offset < len(data):
        if offset + _LENGTH.size > len(data):
            raise RendezvousStateError(f"{what} is corrupt at byte {offset}")
        (size,) = _LENGTH.unpack_from(data, offset)
        start = offset + _LENGTH.size
        if start + size > len(data):
            raise RendezvousStateError(f"{what} is corrupt at byte {offset}")
        items.append(data[start : start + size])
        offset = start + size
    return items


class FileStore(Store):
    """A store in one file, shared by the processes that open the same path.

    Args:
        file_name: The file's path; it is created when missing. Processes on
            one machine, or on machines sharing the filesystem, that open
            the same path share the store.
        world_size: How many users will open the file; the last of them to
            :meth:`close` removes it. -1 (the default) never removes it.
        timeout: The timeout of blocking operations.

    Raises:
        RendezvousConnectionError: The file cannot be created or opened; the
            message names it.
    """

    def __init__(
        self,
        file_name: str | os.PathLike[str],
        world_size: int = -1,
        timeout: Timeout = DEFAULT_STORE_TIMEOUT,
    ) -> None:
        super().__init__(timeout)
        if isinstance(world_size, bool) or not isinstance(world_size, int):
            raise TypeError(f"world_size must be an integer, got {world_size!r}")
        self._path = os.fspath(file_name)
        self._world_size = world_size
        self._mutex = threading.Lock()
        self._cache: dict[bytes, bytes] = {}
        self._pos = 0
        self._inode: int | None = None
        self._closed = False
        self._update(lambda: self._add_raw(_REFCOUNT, 1))

    @property
    def path(self) -> str:
        """The file's path."""
        return self._path

    @property
    def supports_watch(self) -> bool:
        """True: :meth:`watch` polls the file (a change is seen within about 50 ms)."""
        return True

    def clone(self) -> FileStore:
        """Return another user of the same file (same ``world_size`` and timeout), with its own cache."""
        return FileStore(self._path, self._world_size, self.timeout)

    # -- the file ----------------------------------------------------------------

    def _lock(self, fd: int, exclusive: bool) -> None:
        operation = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
        budget = self.timeout.total_seconds()
        clock = current_clock()
        deadline = Deadline.after(budget, clock)
        pause = POLL_FIRST
        while not self._try_lock(fd, operation):
            remaining = deadline.left()
            if remaining <= 0:
                raise RendezvousConnectionError(
                    f"the file store {self._path!r} stayed locked by another process "
                    f"for {budget:g} s"
                )
            clock.sleep(min(pause, remaining))
            pause = min(pause * 2, POLL_MAX)

    @staticmethod
    def _try_lock(fd: int, operation: int) -> bool:
        try:
            fcntl.flock(fd, operation)
        except BlockingIOError:
            return False
        return True

    def _refresh(self, fd: int) -> None:
        info = os.fstat(fd)
        if info.st_ino != self._inode or info.st_size < self._pos:
            # A new file (removed and created again) or a truncated one: read it anew.
            self._cache.clear()
            self._pos = 0
            self._inode = info.st_ino
        if info.st_size == self._pos:
            return
        data = os.pread(fd, info.st_size - self._pos, self._pos)
        offset = 0
        while offset < len(data):
            fields: list[bytes] = []
            for _ in range(2):
                if offset + _LENGTH.size > len(data):
                    raise self._torn(offset)
                (size,) = _LENGTH.unpack_from(data, offset)
                offset += _LENGTH.size
                if offset + size > len(data):
                    raise self._torn(offset - _LENGTH.size)
                fields.append(data[offset : offset + size])
                offset += size
            key, value = fields
            if key.startswith(_DELETED):
                self._cache.pop(key[len(_DELETED) :], None)
            else:
                self._cache[key] = value
        self._pos += len(data)

    def _torn(self, offset: int) -> RendezvousStateError:
        return RendezvousStateError(
            f"the file store {self._path!r} ends in a torn record at byte {self._pos + offset} "
            "(a writer died mid-write?); it cannot be read past it"
        )

    def _append(self, fd: int, records: Sequence[tuple[bytes, bytes]]) -> None:
        """Append records (the exclusive lock held, the cache fresh) and apply them."""
        data = b"".join(_record(key, value) for key, value in records)
        os.lseek(fd, 0, os.SEEK_END)
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        for key, value in records:
            if key.startswith(_DELETED):
                self._cache.pop(key[len(_DELETED) :], None)
            else:
                self._cache[key] = value
        self._pos += len(data)

    def _visit(self, exclusive: bool, operation: Callable[[int], _T]) -> _T:
        """Open and lock the file, bring the cache up to date, and run ``operation``."""
        with self._mutex:
            if self._closed:
                raise RendezvousConnectionError(f"the file store {self._path!r} is closed")
            try:
                fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise RendezvousConnectionError(
                    f"the file store {self._path!r} cannot be opened: {exc}"
                ) from exc
            try:
                self._lock(fd, exclusive)
                self._refresh(fd)
                return operation(fd)
            except OSError as exc:
                raise RendezvousConnectionError(
                    f"the file store {self._path!r} failed: {exc}"
                ) from exc
            finally:
                os.close(fd)

    def _read(self, read: Callable[[], _T]) -> _T:
        return self._visit(False, lambda fd: read())

    def _update(self, update: Callable[[], tuple[list[tuple[bytes, bytes]], _T]]) -> _T:
        def run(fd: int) -> _T:
            records, result = update()
            if records:
                self._append(fd, records)
            return result

        return self._visit(True, run)

    def _changed(self) -> bool:
        try:
            info = os.stat(self._path)
        except FileNotFoundError:
            return True
        return info.st_ino != self._inode or info.st_size != self._pos

    def _poll(
        self, exclusive: bool, ready: Callable[[int], _T | None], timeout: float
    ) -> _T | None:
        """Run ``ready`` on fresh contents until it returns a value or ``timeout`` passes."""
        clock = current_clock()
        deadline = Deadline.after(timeout, clock)
        pause = POLL_FIRST
        while True:
            result = self._visit(exclusive, ready)
            if result is not None:
                return result
            while True:
                remaining = deadline.left()
                if remaining <= 0:
                    return None
                clock.sleep(min(pause, remaining))
                pause = min(pause * 2, POLL_MAX)
                if self._changed():
                    break

    def _add_raw(self, key: bytes, amount: int) -> tuple[list[tuple[bytes, bytes]], int]:
        current = self._cache.get(key, b"")
        try:
            value = (int(current) if current else 0) + int(amount)
        except ValueError:
            raise ValueError(
                f"the value of key {key.decode('utf-8', 'replace')!r} is not an integer: "
                f"{current!r}"
            ) from None
        return [(key, str(value).encode())], value

    @staticmethod
    def _key(key: str) -> bytes:
        return _USER + key.encode("utf-8")

    def _seconds(self, timeout: Timeout | None) -> float:
        return self.timeout.total_seconds() if timeout is None else to_seconds(timeout)

    # -- the Store API --------------------------------------------------------------

    def set(self, key: str, value: Value) -> None:  # noqa: D102 - documented on Store
        record = (self._key(key), to_bytes(value))
        self._update(lambda: ([record], None))

    def get(self, key: str) -> bytes:  # noqa: D102
        return self.multi_get([key])[0]

    def add(self, key: str, amount: int) -> int:  # noqa: D102
        return self._update(lambda: self._add_raw(self._key(key), amount))

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:  # noqa: D102
        raw = self._key(key)
        expected_b, desired_b = to_bytes(expected), to_bytes(desired)

        def update() -> tuple[list[tuple[bytes, bytes]], bytes]:
            current = self._cache.get(raw)
            if current is None:
                return ([], expected_b) if expected_b else ([(raw, desired_b)], desired_b)
            if current == expected_b:
                return [(raw, desired_b)], desired_b
            return [], current

        return self._update(update)

    def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None:  # noqa: D102
        seconds = self._seconds(timeout)
        raw = [self._key(k) for k in keys]
        found = self._poll(
            False, lambda fd: True if all(k in self._cache for k in raw) else None, seconds
        )
        if found is None:
            raise StoreTimeoutError(
                f"timed out after {seconds:g} s waiting for keys {list(keys)!r} "
                f"in the file store {self._path!r}"
            )

    def check(self, keys: Sequence[str]) -> bool:  # noqa: D102
        raw = [self._key(k) for k in keys]
        return self._read(lambda: all(k in self._cache for k in raw))

    def delete_key(self, key: str) -> bool:  # noqa: D102
        raw = self._key(key)

        def update() -> tuple[list[tuple[bytes, bytes]], bool]:
            if raw not in self._cache:
                return [], False
            return [(_DELETED + raw, b"")], True

        return self._update(update)

    def num_keys(self) -> int:
        """Return the number of user keys (torch's counts its bookkeeping keys too)."""
        return self._read(lambda: sum(1 for k in self._cache if k.startswith(_USER)))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:  # noqa: D102
        seconds = self.timeout.total_seconds()
        raw = [self._key(k) for k in keys]

        def ready(fd: int) -> list[bytes] | None:
            values = [self._cache.get(k) for k in raw]
            return None if any(v is None for v in values) else [v for v in values if v is not None]

        values = self._poll(False, ready, seconds)
        if values is None:
            raise StoreTimeoutError(
                f"timed out after {seconds:g} s waiting for keys {list(keys)!r} "
                f"in the file store {self._path!r}"
            )
        return values

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:  # noqa: D102
        check_multi_set(keys, values)
        records = [(self._key(k), to_bytes(v)) for k, v in zip(keys, values, strict=True)]
        self._update(lambda: (records, None))

    def append(self, key: str, value: Value) -> None:  # noqa: D102
        raw, data = self._key(key), to_bytes(value)
        self._update(lambda: ([(raw, self._cache.get(raw, b"") + data)], None))

    def list_keys(self) -> list[str]:  # noqa: D102
        return self._read(
            lambda: [
                k[len(_USER) :].decode("utf-8", "replace")
                for k in self._cache
                if k.startswith(_USER)
            ]
        )

    def _queue(self, raw: bytes) -> list[bytes]:
        return _unframe_items(
            self._cache.get(raw, b""), f"queue {raw.decode('utf-8', 'replace')!r}"
        )

    def queue_push(self, key: str, value: Value) -> None:  # noqa: D102
        raw, item = _QUEUE + key.encode("utf-8"), to_bytes(value)
        self._update(lambda: ([(raw, self._cache.get(raw, b"") + _frame_items([item]))], None))

    def queue_pop(self, key: str, block: bool = True) -> bytes:  # noqa: D102
        raw = _QUEUE + key.encode("utf-8")

        def pop(fd: int) -> bytes | None:
            items = self._queue(raw)
            if not items:
                return None
            self._append(fd, [(raw, _frame_items(items[1:]))])
            return items[0]

        seconds = self.timeout.total_seconds() if block else 0.0
        item = self._poll(True, pop, seconds)
        if item is None:
            raise StoreTimeoutError(
                f"timed out after {seconds:g} s waiting for an item in queue {key!r} "
                f"of the file store {self._path!r}"
            )
        return item

    def queue_len(self, key: str) -> int:  # noqa: D102
        raw = _QUEUE + key.encode("utf-8")
        return self._read(lambda: len(self._queue(raw)))

    def try_multi_get(self, keys: Sequence[str]) -> list[bytes | None]:  # noqa: D102
        raw = [self._key(k) for k in keys]
        return self._read(lambda: [self._cache.get(k) for k in raw])

    def watch(self, key: str, previous: bytes | None, timeout: Timeout) -> bytes | None:  # noqa: D102
        raw = self._key(key)

        def changed(fd: int) -> tuple[bytes | None] | None:
            current = self._cache.get(raw)
            return None if current == previous else (current,)

        result = self._poll(False, changed, to_seconds(timeout))
        return previous if result is None else result[0]

    def close(self) -> None:
        """Stop using the file: count this user out, removing the file after the last.

        Calling it again does nothing. Without ``world_size`` (-1) the file stays.
        """
        if self._closed or not os.path.exists(self._path):
            self._closed = True
            return

        def count_out() -> tuple[list[tuple[bytes, bytes]], tuple[int, int]]:
            finished_records, finished = self._add_raw(_CLEANUP, 1)
            users_records, users = self._add_raw(_REFCOUNT, -1)
            return [*finished_records, *users_records], (finished, users)

        try:
            finished, users = self._update(count_out)
        finally:
            self._closed = True
        if users == 0 and 0 <= self._world_size <= finished:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._path)

    def __repr__(self) -> str:
        return f"FileStore({self._path!r}, world_size={self._world_size})"
