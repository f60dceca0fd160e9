"""Admission: each request, as it arrives, is validated by the handler and priced in tokens.

This runs in the poll thread, before the batcher, so that a bad request is answered at once and never
takes a place in a batch, and so that the batcher knows each request's cost (``Handler.cost``) when it
groups requests by length under the token budget. Whatever the handler's hooks do, raise or return, the
outcome is set on this one request: its neighbours and the poll thread go on.
"""

from __future__ import annotations

from kinference.consumer.request import Request
from kinference.errors import RequestError
from kinference.handlers.base import Handler
from kinference.protocol import ErrorCode


def admit(handler: Handler, request: Request) -> None:
    """Set ``request.item`` and ``request.tokens``, or fail the request with the reason."""
    try:
        request.item = handler.validate(request.payload)
        tokens = handler.cost(request.item)
    except RequestError as exc:
        request.fail(exc)
        return
    except Exception as exc:  # a handler bug must fail this request, not the poll thread
        request.fail(RequestError(f"validate or cost failed: {exc!r}", ErrorCode.HANDLER_ERROR))
        return
    # bool is an int subclass: True is not a token count.
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0):
        request.fail(RequestError(f"cost returned {tokens!r}; expected None or an int >= 0",
                                  ErrorCode.HANDLER_ERROR))
        return
    request.tokens = tokens
