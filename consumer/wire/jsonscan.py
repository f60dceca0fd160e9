"""What a JSON request value costs, read from its bytes at C speed: how deep it nests, and how much memory it takes
once decoded into Python objects. Both run in the poll thread on every JSON record, so both are linear in the
value's bytes with no Python-level work per element: a 960 KB ``[[],[],...]`` (320,000 empty lists) once cost
~1.9 s there in a walk of the decoded document, one Python step per list.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import orjson

from kinference.errors import RequestError
from kinference.protocol import MAX_JSON_DEPTH, ErrorCode

TOO_DEEP = f"request value nests arrays and objects deeper than {MAX_JSON_DEPTH} levels"
"""What a value nested too deep gets, in every format (a Schema Registry record's too: ``schemabounds``)."""

_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_OPEN_LIST, _OPEN_OBJECT, _CLOSE_LIST, _CLOSE_OBJECT = (ord(c) for c in "[{]}")


def nested_within(value: bytes, limit: int) -> bool:
    """Whether the JSON text ``value`` (valid JSON: parse it first) nests arrays and objects at most ``limit``
    levels deep. Brackets inside strings do not count."""
    if value.count(b"[") + value.count(b"{") <= limit:  # too few brackets to nest deeper (one count at C speed)
        return True
    codes = np.frombuffer(_without_escapes(value), dtype=np.uint8)
    # A quote outside a string opens one and the next closes it (escaped quotes are gone): a byte is inside a string
    # when an odd number of quotes precede it. The running count wraps at 256, which keeps its parity.
    inside = np.cumsum(codes == _QUOTE, dtype=np.uint8) & 1
    outside = inside == 0
    steps = ((codes == _OPEN_LIST) | (codes == _OPEN_OBJECT)).astype(np.int32)
    steps -= (codes == _CLOSE_LIST) | (codes == _CLOSE_OBJECT)
    steps *= outside
    return int(np.cumsum(steps, dtype=np.int32).max(initial=0)) <= limit


def _without_escapes(value: bytes) -> bytes:
    """``value`` without its backslash escapes, so that every quote left delimits a string. In valid JSON a
    backslash occurs only in a string, where a run of them pairs up from the left; the replacements go left to
    right, so ``\\\\`` pairs go first and what remains of ``\\"`` is an escaped quote."""
    if _BACKSLASH not in value:
        return value
    return value.replace(b"\\\\", b"").replace(b'\\"', b"")


_SMALL = 16_384
"""A value shorter than this makes too few containers (at most ~5,500) for a collection during its parse to cost
anything, or for its decoded size to matter to the byte budget: the per-record path skips both walks (issue 27)."""
_WORST_RATIO = 40
"""The most memory per byte of any shape measured below (a list of empty lists or dicts: 38x), raw bytes included."""
_TOP_BYTES = 256
"""A small value's own top-level object (a dict: 232 bytes), which a few bytes of JSON can make."""


def loads(value: bytes) -> Any:
    """``orjson.loads(value)``, with the cyclic garbage collector paused while it runs (``collector_paused``) for a
    value large enough for it to matter."""
    if len(value) < _SMALL:
        return orjson.loads(value)
    with collector_paused():
        return orjson.loads(value)


def loads_within_depth(value: bytes) -> Any:
    """``loads(value)``; ``RequestError`` (``bad_request``, ``TOO_DEEP``) when it nests deeper than ``MAX_JSON_DEPTH``
    levels, as kinference's JSON may not. ``orjson.JSONDecodeError`` when it is not JSON."""
    document = loads(value)
    if not nested_within(value, MAX_JSON_DEPTH):
        raise RequestError(TOO_DEEP, ErrorCode.BAD_REQUEST)
    return document


@contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector paused while the block runs. Every list and dict made counts toward the
    collector's next run, and a wide value makes hundreds of thousands: with a loaded model's heap (~400,000
    objects) the collections that ran while one 960 KB ``[[],[],...]`` was parsed took ~4 s, against ~0.3 s for
    the parse with the collector paused and its young collections after it. The collector runs again, over
    whatever the block made, at the next allocation after it."""
    if not gc.isenabled():  # someone else paused it: leave it as they have it
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


_CONTAINER_BYTES = 72
"""A list or dict: its object, garbage-collector header and the slot that holds it (an empty list: 64)."""
_QUOTE_BYTES = 29
"""Half a string's object and slot (a short string: 58), per quote."""
_ELEMENT_BYTES = 36
"""A number and its slot, per comma (an int past the small ones: 36; a float: 32)."""
_ENTRY_BYTES = 40
"""A dict entry's share of its hash table, per colon."""


def decoded_bytes(value: bytes) -> int:
    """About what ``value`` (JSON text) holds once decoded into Python objects, and its own bytes, from counts of its
    structural bytes at C speed; never below it for any shape measured. Measured with tracemalloc, raw bytes
    included (estimate in brackets): a list of empty lists 22x its bytes (38x), of empty dicts 25x (38x), of
    two-character strings 13x (21x), of floats 3.7x (5x), of small ints 5x (20x); ASCII text 2x (2x). A small value
    is charged the worst of these ratios instead of being counted: a few KB either way."""
    if len(value) < _SMALL:
        return _TOP_BYTES + _WORST_RATIO * len(value)
    text = len(value) if value.isascii() else 4 * len(value)  # one non-ASCII character makes a string 2-4 bytes each
    return (len(value) + text + _CONTAINER_BYTES * (value.count(b"[") + value.count(b"{"))
            + _QUOTE_BYTES * value.count(b'"') + _ELEMENT_BYTES * value.count(b",")
            + _ENTRY_BYTES * value.count(b":"))
