"""Admission: each request, as it arrives, is validated by the handler and priced in tokens.

This runs in the poll thread, before the batcher, so that a bad request is answered at once and never
takes a place in a batch, and so that the batcher knows each request's cost (``Handler.cost``) when it
groups requests by length under the token budget.
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
        request.tokens = handler.cost(request.item)
    except RequestError as exc:
        request.fail(exc)
    except Exception as exc:  # a handler bug must fail this request, not the poll thread
        request.fail(RequestError(f"validate failed: {exc!r}", ErrorCode.HANDLER_ERROR))
