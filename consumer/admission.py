"""Admission: requests, as they arrive, are validated by the handler and priced in tokens.

This runs in the poll thread, once per poll, before the batcher, so that a bad request is answered at once and
never takes a place in a batch, and so that the batcher knows each request's cost (``Handler.cost``) when it
groups requests by length under the token budget. Whatever the handler's hooks do, raise or return, each
outcome is set on its own request: its neighbours and the poll thread go on.
"""

from __future__ import annotations

from kinference.consumer.request import Request
from kinference.errors import RequestError
from kinference.handlers.base import Handler
from kinference.protocol import ErrorCode


def admit(handler: Handler, requests: list[Request]) -> None:
    """Set each request's ``item`` and ``tokens``, or fail it with the reason. Never raises."""
    if not requests:
        return
    try:
        items = handler.validate_many([request.payload for request in requests])
        if not isinstance(items, list) or len(items) != len(requests):
            raise TypeError(f"validate_many returned {len(items) if isinstance(items, list) else type(items).__name__}"
                            f" results for {len(requests)} payloads")
    except Exception:  # a bug in the batch hook: validate each request alone, so that one bad payload fails alone
        items = [_validate_one(handler, request.payload) for request in requests]
    for request, item in zip(requests, items, strict=True):
        if isinstance(item, RequestError):
            request.fail(item)
        elif isinstance(item, Exception):  # a handler bug must fail this request, not the poll thread
            request.fail(RequestError(f"validate failed: {item!r}", ErrorCode.HANDLER_ERROR))
        else:
            request.item = item
            _price(handler, request)


def _validate_one(handler: Handler, payload: object) -> object:
    try:
        return handler.validate(payload)
    except Exception as exc:
        return exc


def _price(handler: Handler, request: Request) -> None:
    try:
        tokens = handler.cost(request.item)
    except Exception as exc:
        request.fail(RequestError(f"cost failed: {exc!r}", ErrorCode.HANDLER_ERROR))
        return
    # bool is an int subclass: True is not a token count.
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0):
        request.fail(RequestError(f"cost returned {tokens!r}; expected None or an int >= 0", ErrorCode.HANDLER_ERROR))
        return
    request.tokens = tokens
