"""The schema id a Schema Registry value names, read before its deserializer runs, and what the registry said of it.

Read first (``schema_id``) so that what a value's prefix may make the deserializer do is bounded before it runs: a
Protobuf prefix lists message indexes (the path to the message in the schema's file), and confluent-kafka reads up
to 100,000 of them, a Python step each, before the schema is even looked at: 60 values of 100,000 indexes took
~50 ms each of the poll thread. A real schema nests its messages a few levels deep: more than ``MAX_JSON_DEPTH``
indexes, or an index longer than a varint's ten bytes, is refused after reading at most that many bytes.

Looked up once per interval (``SchemaLookups``): confluent-kafka's client caches the schemas it finds, not the ids it
does not, so 600 records naming an unknown id made 600 registry calls on the poll thread, and the requests behind
them waited 38 s (a 20 ms registry). An id the registry did not find, or failed to look up, is remembered for
``miss_ttl_s``: its records are refused at once with the same error. And the poll thread spends at most
``_MISS_BUDGET_S`` per interval asking about ids that turn out unknown: past that, an id not seen before is refused
without asking (``overloaded``), so that records each naming another unknown id cannot hold it up either. An id
found once costs nothing again (the client's cache).

Poll thread only.
"""

from __future__ import annotations

import struct
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from kinference.consumer.types import Headers
from kinference.errors import RequestError
from kinference.protocol import MAX_JSON_DEPTH, ErrorCode

SCHEMA_ID_HEADER = "__value_schema_id"
"""Where confluent-kafka's serializers put a value's schema id (its GUID) instead of the value's prefix."""
_MAGIC_ID, _MAGIC_GUID = 0, 1
_VARINT_BYTES = 10
"""The most bytes a 64-bit varint takes."""
_MISS_BUDGET_S = 0.5
"""The most time per ``miss_ttl_s`` the poll thread spends on lookups of ids the registry does not find."""

SchemaKey = tuple[int | None, uuid.UUID | None]
"""A schema's id or GUID, as a value names it."""

T = TypeVar("T")


def schema_id(value: bytes, headers: Headers, message_indexes: bool) -> SchemaKey | None:
    """The schema id (or GUID) ``value`` names, in the ``__value_schema_id`` header or its prefix, as confluent-kafka's
    deserializers read it; None when neither can be read (the deserializer then says why). ``message_indexes``:
    Protobuf's prefix, whose index count and varints are bounded here (``RequestError``)."""
    source = next((header for name, header in headers if name == SCHEMA_ID_HEADER and header is not None), value)
    magic = source[:1]
    if magic == bytes([_MAGIC_ID]) and len(source) >= 5:
        key: SchemaKey = (struct.unpack(">I", source[1:5])[0], None)
        rest = 5
    elif magic == bytes([_MAGIC_GUID]) and len(source) >= 17:
        key, rest = (None, uuid.UUID(bytes=source[1:17])), 17
    else:
        return None
    if message_indexes:
        _check_message_indexes(source, rest)
    return key


def _check_message_indexes(source: bytes, at: int) -> None:
    """A Protobuf prefix's message indexes from ``at``: a zigzag varint count, then that many varints."""
    count, at = _varint(source, at)
    count = (count >> 1) ^ -(count & 1)
    if count > MAX_JSON_DEPTH:
        raise RequestError(f"the request's Protobuf prefix lists {count} message indexes; a schema nests messages "
                           f"at most {MAX_JSON_DEPTH} deep here", ErrorCode.BAD_REQUEST)
    for _ in range(max(count, 0)):
        _, at = _varint(source, at)


def _varint(source: bytes, at: int) -> tuple[int, int]:
    """The varint at ``at`` and where the next one starts; ``RequestError`` past ten bytes (the value is then no
    64-bit number: confluent-kafka would read on, in time that grows with its square). Whatever ends early is
    left to the deserializer to refuse."""
    value = 0
    for index, byte in enumerate(source[at:at + _VARINT_BYTES]):
        value |= (byte & 0x7F) << (7 * index)
        if not byte & 0x80:
            return value, at + index + 1
    if len(source) - at < _VARINT_BYTES:
        return value, len(source)
    raise RequestError("the request's Protobuf prefix has a message index longer than a varint's ten bytes",
                       ErrorCode.BAD_REQUEST)


@dataclass(frozen=True)
class _Miss:
    until: float
    message: str
    code: ErrorCode


class SchemaLookups:
    """What the registry said of each schema id that it did not find, or failed to look up, in the last
    ``miss_ttl_s`` seconds; and the time spent asking about those."""

    def __init__(self, miss_ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.miss_ttl_s = miss_ttl_s
        self._clock = clock
        self._found: set[SchemaKey] = set()
        self._missed: dict[SchemaKey, _Miss] = {}
        self._window_ends = clock() + miss_ttl_s
        self._spent_s = 0.0
        """Time spent this window on lookups that found nothing."""

    def read(self, key: SchemaKey | None, decode: Callable[[], T], lookup_error: Callable[[Exception], RequestError
                                                                                         | None]) -> T:
        """``decode()`` the value that names ``key``, unless the registry missed that id lately (its error again) or
        this window's time for misses is spent (``overloaded``). ``lookup_error`` says whether an exception of
        ``decode`` is the lookup's, and as which error: remembered for ``miss_ttl_s``."""
        if key is None or key in self._found:
            return decode()
        now = self._clock()
        self._roll(now)
        missed = self._missed.get(key)
        if missed is not None and missed.until > now:
            raise RequestError(missed.message, missed.code)  # a new one: each request keeps its own
        if self._spent_s >= _MISS_BUDGET_S:
            raise RequestError(f"schema {_named(key)} was not looked up: the Schema Registry did not know "
                               f"{len(self._missed)} schema ids in the last {self.miss_ttl_s:g} s, and lookups of "
                               f"unknown ids wait until the next", ErrorCode.OVERLOADED)
        try:
            record = decode()
        except Exception as exc:
            error = lookup_error(exc)
            if error is None:  # the value, not its schema (read before or after the lookup: not known either way)
                raise
            self._spent_s += self._clock() - now
            self._missed[key] = _Miss(now + self.miss_ttl_s, str(error), error.code)
            raise error from exc
        self._found.add(key)
        return record

    def _roll(self, now: float) -> None:
        """A new window: the time for misses is back, and the misses that expired are forgotten."""
        if now < self._window_ends:
            return
        self._window_ends = now + self.miss_ttl_s
        self._spent_s = 0.0
        self._missed = {key: miss for key, miss in self._missed.items() if miss.until > now}


def _named(key: SchemaKey) -> str:
    number, guid = key
    return f"id {number}" if number is not None else f"GUID {guid}"
