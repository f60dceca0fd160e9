"""Admission: requests, as they arrive, are validated by the handler and priced in tokens.

This runs in the poll thread, once per poll, before the batcher, so that a bad request is answered at once and
never takes a place in a batch, and so that the batcher knows each request's cost (``Handler.cost``) when it
groups requests by length under the token budget. Whatever the handler's hooks do, raise or return, each
outcome is set on its own request: its neighbours and the poll thread go on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kinference.consumer.ledger.request import Request
from kinference.errors import RequestError
from kinference.handlers.base import Handler
from kinference.protocol import ErrorCode


def admit(handler: Handler, requests: list[Request]) -> None:
    """Set each request's ``item`` and ``tokens``, or fail it with the reason. Never raises."""
    if not requests:
        return
    items = _contained(handler.validate_many, [request.payload for request in requests])
    if not isinstance(items, list) or len(items) != len(requests):
        # A bug in the batch hook (it raised, or miscounted): validate each request alone, so that one bad payload
        # fails alone.
        items = [_contained(handler.validate, request.payload) for request in requests]
    for request, item in zip(requests, items, strict=True):
        if isinstance(item, RequestError):
            request.fail(item)
        elif isinstance(item, BaseException):  # a handler bug must fail this request, not the poll thread
            request.fail(RequestError(f"validate failed: {item!r}", ErrorCode.HANDLER_ERROR))
        else:
            request.item = item
            _price(handler, request)


def _contained(hook: Callable[[Any], Any], argument: Any) -> Any:
    """``hook(argument)``, or what it raised. Anything but KeyboardInterrupt: a ``sys.exit`` in a handler's library
    must not end the poll thread."""
    try:
        return hook(argument)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        return exc


def _price(handler: Handler, request: Request) -> None:
    tokens = _contained(handler.cost, request.item)
    if isinstance(tokens, BaseException):
        request.fail(RequestError(f"cost failed: {tokens!r}", ErrorCode.HANDLER_ERROR))
        return
    # bool is an int subclass: True is not a token count.
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0):
        request.fail(RequestError(f"cost returned {tokens!r}; expected None or an int >= 0", ErrorCode.HANDLER_ERROR))
        return
    request.tokens = tokens
