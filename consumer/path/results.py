"""Result validation and reply encoding: a handler's result for one request becomes that request's reply value, or
the ``RequestError`` that answers it instead (NaN or infinity, nesting too deep, not serialisable).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kinference.consumer.ledger.request import Request
from kinference.errors import RequestError
from kinference.protocol import ErrorCode, encode_result

MAX_RESULT_DEPTH = 254
"""The deepest nesting of lists and dicts in a result: orjson writes no deeper, so a deeper result could not be
answered anyway; ``finite`` stops there instead of walking (or, recursing, overflowing) further."""


def finite(value: Any) -> bool:
    """No NaN or infinity anywhere in a result (floats, numpy arrays, nested lists and dicts). ``RequestError``
    (``handler_error``) for a result nested deeper than ``MAX_RESULT_DEPTH``.

    Iterative, with its own stack: a handler's result is untrusted (an echo of a hostile request is one), and a
    recursive walk failed every request of the micro-batch with a RecursionError. A container met twice (shared,
    or holding itself) is walked once."""
    pending: list[tuple[Any, int]] = [(value, 0)]
    seen: set[int] = set()
    while pending:
        value, depth = pending.pop()
        if not isinstance(value, dict | list | tuple):
            if not _scalar_finite(value):
                return False
            continue
        if depth >= MAX_RESULT_DEPTH:
            raise RequestError(f"result is nested deeper than {MAX_RESULT_DEPTH} levels", ErrorCode.HANDLER_ERROR)
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, dict):
            pending.extend((item, depth + 1) for item in value.values())
            continue
        floats_finite = _floats_finite(value)
        if floats_finite is False:
            return False
        if floats_finite is None:
            pending.extend((item, depth + 1) for item in value)
    return True


def _scalar_finite(value: Any) -> bool:
    """A float, or a numpy array or scalar of floats or complex numbers, holds no NaN or infinity."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, np.ndarray | np.floating) and value.dtype.kind in "fc":
        return bool(np.isfinite(value).all())
    return True


def _floats_finite(values: list[Any] | tuple[Any, ...]) -> bool | None:
    """The fast path for a vector of floats: whether all are finite; None when it is not all numbers (then each
    item is checked on its own)."""
    if not values or not isinstance(values[0], float):
        return None
    try:
        return all(map(math.isfinite, values))
    except TypeError:
        return None


def reply_value(request: Request, result: Any) -> bytes:
    """The reply value of one result; ``RequestError`` when it cannot be one."""
    if isinstance(result, RequestError):
        raise result
    encoded = _json_reply(result) if request.reply_format is None else None
    # orjson writes NaN and infinity as null, so kinference's JSON without a null holds neither: the walk of the
    # result (``finite``, a few microseconds for an embedding) is left for a value with a null in it, or one that did
    # not encode (whose error is then the same as before: NaN first). orjson encodes nothing nested deeper than
    # ``finite`` accepts, so an encoded value never skips its depth error either. Other reply formats write NaN as
    # it is: always walked.
    if encoded is not None and b"null" not in encoded:
        return encoded
    if not finite(result):
        # JSON has no NaN or infinity (orjson would write null): a client must not mistake a broken output for a
        # value.
        raise RequestError("result holds NaN or infinity", ErrorCode.HANDLER_ERROR)
    if encoded is not None:
        return encoded
    try:
        return encode_result(result) if request.reply_format is None else request.reply_format.response(result)
    except TypeError as exc:
        raise RequestError(f"result is not JSON-serialisable: {exc}", ErrorCode.HANDLER_ERROR) from exc


def _json_reply(result: Any) -> bytes | None:
    """kinference's JSON reply value of ``result``; None when it does not encode (``reply_value`` says why)."""
    try:
        return encode_result(result)
    except TypeError:
        return None
