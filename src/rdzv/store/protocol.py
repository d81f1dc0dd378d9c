"""Sans-I/O codec of torch's TCPStore wire protocol, plus rdzv's extensions.

Theory of operation
-------------------
torch's protocol has no frame length: a request is a one-byte opcode followed
by fields whose layout depends on the opcode. Integers are little-endian;
strings and byte values are a ``u64`` length followed by the raw bytes; key
lists are a ``u64`` count followed by that many strings. Replies are not
self-describing either: the client knows what shape to expect from the
request it sent.

:class:`RequestParser` (the server side) buffers whatever bytes arrive and
hands out complete :class:`Request` records. Each opcode has a layout, a
tuple of field kinds (key, value, integer, key list...); the parser reads one
field at a time and keeps the fields, and in a list the items, it has read,
with a cursor at the first byte it has not. When the buffer ends inside a
field, it stops there and the next call resumes at that field, so a request
split anywhere (byte by byte even) decodes the same as one delivered whole,
and costs time linear in its size however it is split (a field is re-examined
only for its fixed-size length prefix). Consumed bytes are dropped from the
buffer as it grows. Lengths and counts are checked against the named limits
as soon as they are readable, before anything is buffered for them, and the
opcode against :attr:`RequestParser.allowed` as soon as its byte arrives, so
a server refuses a request that is not allowed yet (one before the
handshake) before reading any of it. Every kind of bad input raises
:class:`ProtocolError` and nothing else.

Sets, the one request torch's clients send without waiting for a reply,
arrive back to back; :meth:`RequestParser.next_sets` decodes such a run in
one tight loop, without the per-request path's field dispatch, stopping at
the first byte that is not a complete, allowed set within the limits.

The encoders come from the same table: each layout has one encoder, which
takes the fields in layout order (:func:`request_encoder`, a client's fast
path), and :func:`encode_request` checks a :class:`Request` against the
limits and hands its fields to that encoder. A layout is written once, so
the parser and the encoders cannot disagree.

Replies carry no layout of their own: the client knows which fields come.
Each field has a :data:`Decoder`, a function of the received bytes and a
position; :class:`ReplyReader` (the client side) applies them to the bytes
it buffered, and a client may apply one to a reply it received whole. A
read that lacks bytes returns None and consumes nothing.

rdzv's extensions use opcodes from :data:`EXTENSION_BASE` up, which torch
never sends; torch's server closes the connection on any of them, so an rdzv
client first learns what it talks to with a ``PING`` carrying
:data:`PROBE_NONCE` (a value above Linux's largest pid, so a torch client,
which pings with its pid, never sends it). torch's server echoes the nonce;
rdzv's server answers :data:`SERVER_HELLO` with feature bits.

Authentication (rdzv only) is a challenge and response over HMAC-SHA256: the
client asks for a server nonce (``AUTH_CHALLENGE``) and answers with its own
nonce and :func:`auth_tag` under :data:`CLIENT_AUTH_LABEL`; the server replies
with its tag under :data:`SERVER_AUTH_LABEL`, so each side proves it knows
the secret without sending it, and neither tag can be replayed as the other.

Size: longer than the project's ~600-line guide: one wire protocol. Its
layout table drives both the request parser and the encoders, and the
limits bound all three (an opcode of a known shape is one row of the table);
split, the parser and the encoders would each import the table's private
field kinds.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Callable, Container, Mapping
from enum import IntEnum
from itertools import chain
from types import MappingProxyType
from typing import Any, Final, NamedTuple, TypeVar

__all__ = [
    "AUTH_MAC_BYTES",
    "AUTH_NONCE_BYTES",
    "CLIENT_AUTH_LABEL",
    "DECODED_ITEM_OVERHEAD",
    "EXTENSION_BASE",
    "FEATURE_AUTH_REQUIRED",
    "FRAME_BYTES",
    "MAX_KEY_BYTES",
    "MAX_MULTI_KEYS",
    "MAX_REQUEST_BYTES",
    "MAX_VALUE_BYTES",
    "MAX_WILL_BYTES",
    "PROBE_NONCE",
    "SERVER_AUTH_LABEL",
    "SERVER_HELLO",
    "SERVER_HELLO_MASK",
    "VALIDATE_MAGIC",
    "AuthStatus",
    "CheckResult",
    "GetWaitStatus",
    "Op",
    "ProtocolError",
    "RefusedOpcodeError",
    "ReplyReader",
    "Request",
    "RequestParser",
    "WaitResult",
    "WatchStatus",
    "Decoder",
    "auth_tag",
    "decode_bytes",
    "decode_get_wait",
    "decode_i64",
    "decode_raw",
    "decode_u8",
    "decode_u32",
    "encode_bytes",
    "encode_i64",
    "encode_key_list",
    "encode_request",
    "encode_u8",
    "encode_u32",
    "request_encoder",
]

MAX_KEY_BYTES = 8 * 1024
"""Longest key accepted, in bytes (torch's libuv server limit)."""
MAX_VALUE_BYTES = 8 * 1024 * 1024
"""Longest value accepted, in bytes (torch's libuv server limit)."""
MAX_WILL_BYTES = 1024
"""Longest value of a ``WILL``, in bytes: a connection holds it until it closes."""
MAX_MULTI_KEYS = 128 * 1024
"""Most keys accepted in one multi-key request (torch's libuv server limit)."""
MAX_REQUEST_BYTES = 256 * 1024 * 1024
"""Largest request accepted as a whole, in bytes (rdzv's bound on a multi-set;
torch sets none, but 128 Ki values of up to 8 MiB each would be 1 TiB)."""
DECODED_ITEM_OVERHEAD = 48
"""Bytes of memory a decoded key or value costs beyond its wire bytes, an upper
bound: a bytes object's 33-byte header, rounded with the key by CPython's
allocator to 16 bytes (48 for keys of up to 14 bytes), and its list slot (8,
plus the list's spare room), less the 8-byte length prefix the wire bytes
already count. Decoded 1-byte keys take about five times their wire size."""
MAX_REPLY_ITEMS = 1 << 31
"""Most items a client accepts in one list reply (a sanity bound for LIST_KEYS)."""

VALIDATE_MAGIC = 0x3C85F7CE
"""The magic number a client sends in ``VALIDATE`` as its first request."""
EXTENSION_BASE = 0x40
"""The first opcode of rdzv's extensions; torch's opcodes are all below it."""
PROBE_NONCE = 0x72647A76
"""The ``PING`` nonce with which an rdzv client asks "are you an rdzv server?"."""
SERVER_HELLO = 0x52440000
"""An rdzv server's answer to :data:`PROBE_NONCE`; the low 16 bits are features."""
SERVER_HELLO_MASK = 0xFFFF0000
"""The bits of a ``PING`` reply that identify an rdzv server."""
FEATURE_AUTH_REQUIRED = 0x0001
"""Feature bit: the server refuses every request until the client authenticates."""
AUTH_NONCE_BYTES = 32
"""Length of the random nonces of the authentication exchange."""
AUTH_MAC_BYTES = 32
"""Length of an HMAC-SHA256 tag."""
CLIENT_AUTH_LABEL = b"rdzv-store-auth client\x00"
"""What the client's authentication tag is computed over, before the nonces."""
SERVER_AUTH_LABEL = b"rdzv-store-auth server\x00"
"""What the server's authentication tag is computed over, before the nonces."""


class Op(IntEnum):
    """Request opcodes: torch's (0-18) and rdzv's extensions (from 0x40)."""

    VALIDATE = 0
    SET = 1
    COMPARE_SET = 2
    GET = 3
    ADD = 4
    CHECK = 5
    WAIT = 6
    GETNUMKEYS = 7
    DELETE_KEY = 8
    APPEND = 9
    MULTI_GET = 10
    MULTI_SET = 11
    CANCEL_WAIT = 12
    PING = 13
    QUEUE_PUSH = 14
    QUEUE_POP = 15
    QUEUE_LEN = 16
    LIST_KEYS = 17
    BARRIER = 18
    # rdzv extensions, never sent by torch clients.
    AUTH_CHALLENGE = 0x40
    """Ask for a server nonce; reply: the nonce."""
    AUTH_RESPONSE = 0x41
    """Client nonce + HMAC over both nonces; reply: status, then the server's HMAC."""
    WATCH = 0x42
    """Key, optional previous value, timeout in ms; reply: a :class:`WatchStatus`."""
    GET_WAIT = 0x43
    """Key and timeout in ms: get in one round trip; reply: a :class:`GetWaitStatus`."""
    MULTI_TRY_GET = 0x44
    """Keys; reply: per key a presence byte, then the value when present."""
    WILL = 0x45
    """Key and value: the server sets the key to the value when this
    connection closes, unless a later ``WILL`` with an empty key withdrew it
    (one will a connection; a new one replaces it); reply: one zero byte."""


class CheckResult(IntEnum):
    """Reply byte of ``CHECK``."""

    READY = 0
    NOT_READY = 1


class WaitResult(IntEnum):
    """Reply bytes of ``WAIT``, ``BARRIER`` and ``CANCEL_WAIT``."""

    STOP_WAITING = 0
    WAIT_CANCELED = 1


class WatchStatus(IntEnum):
    """First reply byte of ``WATCH``."""

    PRESENT = 0
    """The value changed; the new value follows."""
    ABSENT = 1
    """The key was deleted (or is absent while the caller saw a value)."""
    UNCHANGED = 2
    """The timeout elapsed without a change."""


class GetWaitStatus(IntEnum):
    """First reply byte of ``GET_WAIT``."""

    FOUND = 0
    """The value follows."""
    TIMED_OUT = 1
    """The key did not appear in time."""


class AuthStatus(IntEnum):
    """First reply byte of ``AUTH_RESPONSE``."""

    OK = 0
    REFUSED = 1


class ProtocolError(Exception):
    """Raised for any malformed, over-limit or unknown request or reply."""


class RefusedOpcodeError(ProtocolError):
    """Raised when a request's opcode is not one the parser accepts now.

    Attributes:
        op: The refused opcode.
    """

    def __init__(self, op: int) -> None:
        super().__init__(f"opcode {op} is not allowed here")
        self.op = op


class _IncompleteError(Exception):
    """Internal: the buffer ends before the current request or field does."""


class Request(NamedTuple):
    """One decoded request.

    The meaning of the fields depends on the opcode:

    * ``keys``: the key(s) of the request (empty for key-less requests).
    * ``values``: SET/APPEND/QUEUE_PUSH value; COMPARE_SET expected and
      desired; MULTI_SET values; WATCH previous value (empty when the caller
      saw the key absent); AUTH_RESPONSE client nonce and tag.
    * ``number``: VALIDATE magic, PING nonce, ADD amount, BARRIER world size,
      WATCH/GET_WAIT timeout in milliseconds; 0 otherwise.
    """

    op: int
    keys: tuple[bytes, ...] = ()
    values: tuple[bytes, ...] = ()
    number: int = 0


_T = TypeVar("_T")
_SET: Final = int(Op.SET)
_FIRST_SET_WINDOW: Final = 4096
"""Bytes :meth:`RequestParser.next_sets` copies first, doubled as the run goes on."""
_U8 = struct.Struct("<B")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_unpack_u64 = _U64.unpack_from


def _blob(buf: bytearray, pos: int, limit: int, what: str) -> tuple[bytes, int]:
    start = pos + 8
    if start > len(buf):
        raise _IncompleteError
    size = _U64.unpack_from(buf, pos)[0]
    if size > limit:
        raise ProtocolError(f"{what} of {size} bytes exceeds the limit of {limit} bytes")
    end = start + size
    if end > len(buf):
        raise _IncompleteError
    return bytes(buf[start:end]), end


def _read_count(buf: bytearray, pos: int) -> tuple[int, int]:
    end = pos + 8
    if end > len(buf):
        raise _IncompleteError
    count = _U64.unpack_from(buf, pos)[0]
    if count > MAX_MULTI_KEYS:
        raise ProtocolError(f"{count} keys in one request exceeds the limit of {MAX_MULTI_KEYS}")
    return count, end


# The kinds of field a request is made of; a request's layout is a tuple of them.
_KEY = 0
_VALUE = 1
_I64_FIELD = 2
_U32_FIELD = 3
_KEYS = 4
"""A ``u64`` count, then that many keys: one field, a tuple of keys."""
_PAIRS = 5
"""A count, then that many key and value pairs: one field, (keys, values)."""
_PREVIOUS = 6
"""WATCH's presence flag, then the previous value when the flag is 1: a tuple."""
_AUTH = 7
"""AUTH_RESPONSE's fixed-size nonce and tag: a tuple of the two."""
_TIMEOUT = 8
"""An ``i64`` timeout in milliseconds, which must not be negative."""

_Build = Callable[[Op, list[Any]], Request]
_Layout = tuple[Op, tuple[int, ...], _Build]


_BUILDS: Final[Mapping[tuple[int, ...], _Build]] = {
    (): lambda op, _f: Request(op),
    (_U32_FIELD,): lambda op, f: Request(op, number=f[0]),
    (_KEY,): lambda op, f: Request(op, (f[0],)),
    (_KEY, _VALUE): lambda op, f: Request(op, (f[0],), (f[1],)),
    (_KEY, _VALUE, _VALUE): lambda op, f: Request(op, (f[0],), (f[1], f[2])),
    (_KEY, _I64_FIELD): lambda op, f: Request(op, (f[0],), (), f[1]),
    (_KEY, _TIMEOUT): lambda op, f: Request(op, (f[0],), (), f[1]),
    (_KEY, _PREVIOUS, _TIMEOUT): lambda op, f: Request(op, (f[0],), f[1], f[2]),
    (_KEYS,): lambda op, f: Request(op, f[0]),
    (_PAIRS,): lambda op, f: Request(op, *f[0]),
    (_AUTH,): lambda op, f: Request(op, (), f[0]),
}
"""How the parser makes a :class:`Request` of each shape of layout from its fields."""

_LAYOUTS: dict[int, _Layout] = {
    int(op): (op, kinds, _BUILDS[kinds])
    for op, kinds in (
        (Op.VALIDATE, (_U32_FIELD,)),
        (Op.SET, (_KEY, _VALUE)),
        (Op.COMPARE_SET, (_KEY, _VALUE, _VALUE)),
        (Op.GET, (_KEY,)),
        (Op.ADD, (_KEY, _I64_FIELD)),
        (Op.CHECK, (_KEYS,)),
        (Op.WAIT, (_KEYS,)),
        (Op.GETNUMKEYS, ()),
        (Op.DELETE_KEY, (_KEY,)),
        (Op.APPEND, (_KEY, _VALUE)),
        (Op.MULTI_GET, (_KEYS,)),
        (Op.MULTI_SET, (_PAIRS,)),
        (Op.CANCEL_WAIT, ()),
        (Op.PING, (_U32_FIELD,)),
        (Op.QUEUE_PUSH, (_KEY, _VALUE)),
        (Op.QUEUE_POP, (_KEY,)),
        (Op.QUEUE_LEN, (_KEY,)),
        (Op.LIST_KEYS, ()),
        (Op.BARRIER, (_KEY, _I64_FIELD)),
        (Op.AUTH_CHALLENGE, ()),
        (Op.AUTH_RESPONSE, (_AUTH,)),
        (Op.WATCH, (_KEY, _PREVIOUS, _TIMEOUT)),
        (Op.GET_WAIT, (_KEY, _TIMEOUT)),
        (Op.MULTI_TRY_GET, (_KEYS,)),
        (Op.WILL, (_KEY, _VALUE)),
    )
}


def _fixed_size(kinds: tuple[int, ...]) -> int | None:
    sizes = {_I64_FIELD: 8, _TIMEOUT: 8, _U32_FIELD: 4, _AUTH: AUTH_NONCE_BYTES + AUTH_MAC_BYTES}
    if not all(kind in sizes for kind in kinds):
        return None
    return 1 + sum(sizes[kind] for kind in kinds)


FRAME_BYTES: Final[Mapping[int, int]] = MappingProxyType(
    {
        code: size
        for code, (_op, kinds, _build) in _LAYOUTS.items()
        if (size := _fixed_size(kinds)) is not None
    }
)
"""The size in bytes of every request whose size is fixed (opcode included),
by opcode: the handshake's requests all are, so a server that accepts only
those before the handshake buffers at most the largest of them for a peer
that never completed it."""


class RequestParser:
    """Incremental decoder of a stream of requests (the server side).

    Feed it bytes as they arrive with :meth:`feed`; take complete requests
    with :meth:`next_request` until it returns None. A request is decoded
    field by field as its bytes arrive: the fields already read (and, in a
    list, the items already read) are kept, and the next attempt resumes at
    the first unread byte, so a request costs time linear in its size however
    it is split.

    Attributes:
        allowed: The opcodes accepted now, or None for every known opcode;
            any other opcode raises :class:`RefusedOpcodeError` as soon as its
            byte arrives, before any of its fields is read. The caller may
            change it between requests (a server does, as a client moves
            through the handshake).
        on_count: Called with the opcode and the number of keys of a
            request naming a list of keys as soon as that number is read,
            before any key; it may raise :class:`ProtocolError` to refuse
            the request then (a server uses it to count a ``WAIT`` against
            its budget before the keys arrive). None calls nothing.
    """

    __slots__ = (
        "_buf",
        "_count",
        "_fields",
        "_items",
        "_layout",
        "_pos",
        "_start",
        "allowed",
        "on_count",
    )

    _COMPACT_AT = 64 * 1024

    def __init__(self) -> None:
        self.allowed: Container[int] | None = None
        self.on_count: Callable[[Op, int], None] | None = None
        self._buf = bytearray()
        self._pos = 0
        """Where decoding resumes: everything before it is decoded."""
        self._start = 0
        """Where the current request's opcode is (negative once dropped from the buffer)."""
        self._layout: _Layout | None = None
        """The layout of the request being decoded, or None between requests."""
        self._fields: list[Any] = []
        self._items: list[bytes] = []
        self._count = -1
        """Items of the list field being read (-1 before its count is read)."""

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Append received bytes: any amount, split anywhere."""
        self._buf += data

    @property
    def pending(self) -> int:
        """The number of buffered bytes not yet decoded into a request."""
        start = self._pos if self._layout is None else self._start
        return len(self._buf) - start

    @property
    def held(self) -> int:
        """The memory, in bytes, that the bytes of :attr:`pending` hold.

        Each item already decoded from an incomplete list counts
        :data:`DECODED_ITEM_OVERHEAD` more than its wire bytes.
        """
        return self.pending + DECODED_ITEM_OVERHEAD * len(self._items)

    def next_request(self) -> Request | None:
        """Decode the next complete request; None when the buffered bytes hold no complete one yet.

        Raises:
            RefusedOpcodeError: The opcode is not in :attr:`allowed`.
            ProtocolError: The bytes are not a valid request.
        """
        buf = self._buf
        pos = self._pos
        layout = self._layout
        if layout is None:
            if pos >= len(buf):
                if pos:
                    buf.clear()
                    self._pos = 0
                return None
            code = buf[pos]
            layout = _LAYOUTS.get(code)
            if layout is None:
                raise ProtocolError(f"unknown opcode {code}")
            allowed = self.allowed
            if allowed is not None and code not in allowed:
                raise RefusedOpcodeError(code)
            self._start = pos
            pos += 1
            fields: list[Any] = []
        else:
            fields = self._fields
        op, kinds, build = layout
        field: Any
        try:
            for kind in kinds[len(fields) :] if fields else kinds:
                if kind == _KEY:
                    field, pos = _blob(buf, pos, MAX_KEY_BYTES, "key")
                elif kind == _VALUE:
                    field, pos = _blob(buf, pos, MAX_VALUE_BYTES, "value")
                elif kind == _I64_FIELD:
                    field, pos = _read_fixed(buf, pos, _I64)
                elif kind == _TIMEOUT:
                    field, pos = _read_fixed(buf, pos, _I64)
                    if field < 0:
                        raise ProtocolError(
                            f"{op.name} timeout must be non-negative, got {field} ms"
                        )
                elif kind == _U32_FIELD:
                    field, pos = _read_fixed(buf, pos, _U32)
                elif kind in (_KEYS, _PAIRS):
                    field, pos = self._read_list(op, buf, pos, kind == _PAIRS)
                elif kind == _PREVIOUS:
                    field, pos = _read_previous(buf, pos)
                else:
                    field, pos = _read_auth(buf, pos)
                fields.append(field)
        except _IncompleteError as exc:
            self._suspend(layout, fields, exc.args[0] if exc.args else pos)
            return None
        self._layout = None
        self._pos = pos
        return build(op, fields)

    def next_sets(self, limit: int) -> list[tuple[bytes, bytes]]:
        """Decode the run of complete ``SET`` requests at the head of the buffer.

        The fast path of the most frequent request: torch's clients send
        sets without waiting for a reply, so they arrive back to back, and
        this loop decodes them without :meth:`next_request`'s field
        dispatch. It stops at anything else (another opcode, an incomplete set,
        a length over its limit, a request partly decoded already, sets not
        :attr:`allowed`) and leaves it to :meth:`next_request`, which
        decodes it or raises as always.

        Return the ``(key, value)`` pairs of at most ``limit`` sets, in arrival
        order; none when the next request is no complete set.
        """
        buf = self._buf
        pos = self._pos
        if (
            self._layout is not None
            or (self.allowed is not None and _SET not in self.allowed)
            or not (first := _set_size(buf, pos))
        ):
            return []
        end = len(buf)
        pairs: list[tuple[bytes, bytes]] = []
        append = pairs.append
        unpack = _U64.unpack_from
        # Decode from an immutable copy of a window of the buffer, whose
        # slices are the keys and values themselves (a bytearray's would be
        # copied twice). When a set runs past the window but not past the
        # buffer, the window doubles (or grows to that set), so a lone set
        # copies little, a long run is copied about once, and nothing is
        # copied while the first set is incomplete.
        window = max(_FIRST_SET_WINDOW, first)
        while limit:
            chunk = bytes(buf[pos : pos + window])
            size = len(chunk)
            at = need = 0
            while limit:
                if at >= size:
                    need = at + 1
                    break
                if chunk[at] != _SET:
                    break
                key = at + 9
                if key > size:
                    need = key
                    break
                key_size = unpack(chunk, at + 1)[0]
                value = key + key_size + 8
                if key_size > MAX_KEY_BYTES:
                    break
                if value > size:
                    need = value
                    break
                value_size = unpack(chunk, value - 8)[0]
                stop = value + value_size
                if value_size > MAX_VALUE_BYTES:
                    break
                if stop > size:
                    need = stop
                    break
                append((chunk[key : value - 8], chunk[value:stop]))
                at = stop
                limit -= 1
            pos += at
            need -= at
            if need <= 0 or pos + need > end:
                break  # no set next, or the buffer ends inside it
            window = max(window * 2, need)
        self._pos = pos
        return pairs

    def _suspend(self, layout: _Layout, fields: list[Any], resume: int) -> None:
        """Keep what was decoded of an incomplete request and where to resume."""
        self._layout = layout
        self._fields = fields
        buf = self._buf
        if len(buf) - self._start > MAX_REQUEST_BYTES:
            raise ProtocolError(
                f"request {layout[0]} exceeds {MAX_REQUEST_BYTES} bytes and is still incomplete"
            )
        if resume >= self._COMPACT_AT:
            del buf[:resume]
            self._start -= resume
            resume = 0
        self._pos = resume

    def _read_list(
        self, op: Op, buf: bytearray, pos: int, pairs: bool
    ) -> tuple[tuple[bytes, ...] | tuple[tuple[bytes, ...], tuple[bytes, ...]], int]:
        """Read a counted list of keys (or of key and value pairs), resumably.

        Raises:
            _IncompleteError: Carrying where to resume: after the last whole item.
        """
        count = self._count
        if count < 0:
            count, pos = _read_count(buf, pos)
            if self.on_count is not None:
                self.on_count(op, count)
            if pairs:
                count *= 2
            self._count = count
            self._items = []
        items = self._items
        try:
            for index in range(len(items), count):
                if pairs and index & 1:
                    item, pos = _blob(buf, pos, MAX_VALUE_BYTES, "value")
                else:
                    item, pos = _blob(buf, pos, MAX_KEY_BYTES, "key")
                items.append(item)
        except _IncompleteError:
            raise _IncompleteError(pos) from None
        self._count = -1
        self._items = []
        if pairs:
            return (tuple(items[0::2]), tuple(items[1::2])), pos
        return tuple(items), pos


def _set_size(buf: bytearray, pos: int) -> int:
    """Return the size of the complete ``SET`` at ``pos``; 0 if none is there.

    None is there: another opcode, an incomplete set, or a length over its limit.
    """
    end = len(buf)
    if pos + 9 > end or buf[pos] != _SET:
        return 0
    key_size: int = _U64.unpack_from(buf, pos + 1)[0]
    value = pos + 17 + key_size
    if key_size > MAX_KEY_BYTES or value > end:
        return 0
    value_size: int = _U64.unpack_from(buf, value - 8)[0]
    stop = value + value_size
    if value_size > MAX_VALUE_BYTES or stop > end:
        return 0
    return stop - pos


def _read_fixed(buf: bytearray, pos: int, fmt: struct.Struct) -> tuple[int, int]:
    end = pos + fmt.size
    if end > len(buf):
        raise _IncompleteError
    value: int = fmt.unpack_from(buf, pos)[0]
    return value, end


def _read_auth(buf: bytearray, pos: int) -> tuple[tuple[bytes, bytes], int]:
    """Read AUTH_RESPONSE's client nonce and tag."""
    nonce_end = pos + AUTH_NONCE_BYTES
    end = nonce_end + AUTH_MAC_BYTES
    if end > len(buf):
        raise _IncompleteError
    return (bytes(buf[pos:nonce_end]), bytes(buf[nonce_end:end])), end


def _read_previous(buf: bytearray, pos: int) -> tuple[tuple[bytes, ...], int]:
    """Read WATCH's presence flag and, when it is set, the previous value."""
    if pos >= len(buf):
        raise _IncompleteError
    flag = buf[pos]
    if flag > 1:
        raise ProtocolError(f"WATCH presence flag must be 0 or 1, got {flag}")
    if not flag:
        return (), pos + 1
    value, pos = _blob(buf, pos + 1, MAX_VALUE_BYTES, "value")
    return (value,), pos


_TIMED_OUT: Final = int(GetWaitStatus.TIMED_OUT)
_Buffer = bytes | bytearray
Decoder = Callable[[_Buffer, int], "tuple[_T, int] | None"]
"""A reply field's decoder: from a buffer and a position, the field and
where it ends, or None while the buffer ends inside it."""


def _fixed_decoder(fmt: struct.Struct) -> Decoder[int]:
    size = fmt.size
    unpack = fmt.unpack_from

    def decode(buf: _Buffer, pos: int) -> tuple[int, int] | None:
        end = pos + size
        if end > len(buf):
            return None
        return unpack(buf, pos)[0], end

    return decode


decode_u8: Final = _fixed_decoder(_U8)
"""Decode an unsigned byte (a :data:`Decoder`)."""
decode_u32: Final = _fixed_decoder(_U32)
"""Decode a little-endian ``u32`` (a :data:`Decoder`)."""
decode_i64: Final = _fixed_decoder(_I64)
"""Decode a little-endian ``i64`` (a :data:`Decoder`)."""


def decode_bytes(buf: _Buffer, pos: int, limit: int = MAX_VALUE_BYTES) -> tuple[bytes, int] | None:
    """Decode a length-prefixed byte string (a :data:`Decoder`).

    Raises:
        ProtocolError: The announced length exceeds ``limit``.
    """
    start = pos + 8
    length = len(buf)
    if start > length:
        return None
    (size,) = _unpack_u64(buf, pos)
    if size > limit:
        raise ProtocolError(f"reply of {size} bytes exceeds the limit of {limit} bytes")
    end = start + size
    if end > length:
        return None
    value = buf[start:end]
    return (value if type(value) is bytes else bytes(value)), end


def decode_get_wait(buf: _Buffer, pos: int) -> tuple[tuple[int, bytes], int] | None:
    """Decode a ``GET_WAIT`` reply (a :data:`Decoder`): its status and value (empty if none).

    Raises:
        ProtocolError: The value's announced length exceeds :data:`MAX_VALUE_BYTES`.
    """
    if pos >= len(buf):
        return None
    status = buf[pos]
    if status == _TIMED_OUT:
        return (status, b""), pos + 1
    found = decode_bytes(buf, pos + 1)
    if found is None:
        return None
    value, end = found
    return (status, value), end


def decode_raw(size: int) -> Decoder[bytes]:
    """Return the :data:`Decoder` of a field of exactly ``size`` bytes."""

    def decode(buf: _Buffer, pos: int) -> tuple[bytes, int] | None:
        end = pos + size
        return None if end > len(buf) else (bytes(buf[pos:end]), end)

    return decode


class ReplyReader:
    """Incremental decoder of replies (the client side).

    The client feeds received bytes with :meth:`feed` and reads the fields it
    expects with their :data:`Decoder`; a read returns None, consuming
    nothing, when the field is not complete yet.
    """

    __slots__ = ("_buf", "_pos")

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pos = 0

    def feed(self, data: bytes) -> None:
        """Append received bytes."""
        if self._pos and self._pos == len(self._buf):
            self._buf.clear()
            self._pos = 0
        self._buf += data

    def clear(self) -> None:
        """Drop every buffered byte (after the connection was reset)."""
        self._buf.clear()
        self._pos = 0

    @property
    def pending(self) -> int:
        """The number of buffered bytes not read yet."""
        return len(self._buf) - self._pos

    def read(self, decode: Decoder[_T]) -> _T | None:
        """Read the next field with its decoder; None, consuming nothing, if it is incomplete."""
        found = decode(self._buf, self._pos)
        if found is None:
            return None
        value, self._pos = found
        return value


def encode_u8(value: int) -> bytes:
    """Encode an unsigned byte (0-255)."""
    return _U8.pack(value)


def encode_u32(value: int) -> bytes:
    """Encode a little-endian ``u32``."""
    return _U32.pack(value)


def encode_i64(value: int) -> bytes:
    """Encode a little-endian ``i64``."""
    return _I64.pack(value)


def encode_bytes(value: bytes | bytearray) -> bytes:
    """Encode a length-prefixed byte string: its ``u64`` length, then the bytes."""
    return _U64.pack(len(value)) + value


def encode_key_list(keys: list[bytes] | tuple[bytes, ...]) -> bytes:
    """Encode a counted list of keys: the ``u64`` count, then each key."""
    return _U64.pack(len(keys)) + b"".join(_U64.pack(len(k)) + k for k in keys)


def _encoder(head: bytes, kinds: tuple[int, ...]) -> Callable[..., bytes]:
    """Return the encoder of a layout: from its fields, in order, to the frame.

    The fields are what :class:`RequestParser` reads: a key or value is
    bytes, a number an int, a list of keys a tuple, ``_PAIRS`` the keys and
    the values, ``_PREVIOUS`` and ``_AUTH`` a tuple of values.
    """
    size = _U64.pack
    number = _I64.pack
    if kinds == ():
        return lambda: head
    if kinds == (_U32_FIELD,):
        return lambda value: head + _U32.pack(value)
    if kinds == (_KEY,):
        return lambda key: b"".join((head, size(len(key)), key))
    if kinds == (_KEY, _VALUE):
        return lambda key, value: b"".join((head, size(len(key)), key, size(len(value)), value))
    if kinds == (_KEY, _VALUE, _VALUE):
        return lambda key, old, new: b"".join(
            (head, size(len(key)), key, size(len(old)), old, size(len(new)), new)
        )
    if kinds in ((_KEY, _I64_FIELD), (_KEY, _TIMEOUT)):
        return lambda key, value: b"".join((head, size(len(key)), key, number(value)))
    if kinds == (_KEYS,):
        return lambda keys: head + encode_key_list(keys)
    if kinds == (_PAIRS,):
        return lambda pairs: b"".join(
            [
                head,
                size(len(pairs[0])),
                *map(encode_bytes, chain.from_iterable(zip(*pairs, strict=True))),
            ]
        )
    if kinds == (_AUTH,):
        return lambda pair: b"".join((head, *pair))
    if kinds == (_KEY, _PREVIOUS, _TIMEOUT):
        return lambda key, previous, value: b"".join(
            (
                head,
                size(len(key)),
                key,
                b"\x01" + encode_bytes(previous[0]) if previous else b"\x00",
                number(value),
            )
        )
    raise ValueError(f"no encoder for the layout {kinds}")


_ENCODERS: Final[Mapping[int, Callable[..., bytes]]] = MappingProxyType(
    {code: _encoder(bytes((code,)), kinds) for code, (_op, kinds, _build) in _LAYOUTS.items()}
)


def request_encoder(op: Op) -> Callable[..., bytes]:
    """Return the encoder of ``op``'s requests, made from its layout; it checks nothing.

    The fast path of a client: the encoder takes the layout's fields in
    order (``SET``: key, value; ``ADD``: key, amount) and returns the frame
    that :func:`encode_request` would, skipping its checks of the limits.
    """
    return _ENCODERS[op]


def encode_request(request: Request) -> bytes:
    """Encode a request (its fields must fit its opcode), the inverse of :class:`RequestParser`.

    Raises:
        ProtocolError: A key, value or count exceeds the limits, or the
            fields do not fit the opcode.
    """
    op, keys, values, number = request
    layout = _LAYOUTS.get(op)
    if layout is None:
        raise ProtocolError(f"unknown opcode {op}")
    for key in keys:
        if len(key) > MAX_KEY_BYTES:
            raise ProtocolError(f"key of {len(key)} bytes exceeds the limit of {MAX_KEY_BYTES}")
    for value in values:
        if len(value) > MAX_VALUE_BYTES:
            raise ProtocolError(
                f"value of {len(value)} bytes exceeds the limit of {MAX_VALUE_BYTES}"
            )
    kinds = layout[1]
    if (_KEYS in kinds or _PAIRS in kinds) and len(keys) > MAX_MULTI_KEYS:
        raise ProtocolError(f"{len(keys)} keys exceeds the limit of {MAX_MULTI_KEYS}")
    if _PAIRS in kinds and len(keys) != len(values):
        raise ProtocolError(
            f"MULTI_SET needs as many keys as values, got {len(keys)} keys and {len(values)} values"
        )
    if _AUTH in kinds and list(map(len, values)) != [AUTH_NONCE_BYTES, AUTH_MAC_BYTES]:
        raise ProtocolError("AUTH_RESPONSE needs a 32-byte nonce and a 32-byte tag")
    fields: list[Any] = []
    taken = 0
    try:
        for kind in kinds:
            if kind == _KEY:
                fields.append(keys[0])
            elif kind == _VALUE:
                fields.append(values[taken])
                taken += 1
            elif kind in (_I64_FIELD, _U32_FIELD, _TIMEOUT):
                fields.append(number)
            else:
                fields.append({_KEYS: keys, _PAIRS: (keys, values)}.get(kind, values))
        return _ENCODERS[op](*fields)
    except (IndexError, ValueError, struct.error) as exc:
        raise ProtocolError(f"request fields do not fit opcode {op}: {exc}") from exc


def auth_tag(secret: bytes, label: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """Compute the 32-byte HMAC-SHA256 tag of one side of the authentication exchange.

    ``label`` says which side proves itself (the client's or the server's label).
    """
    return hmac.new(secret, label + server_nonce + client_nonce, hashlib.sha256).digest()
