"""Admission: a model's runner takes a fetch's requests through it first (``Admission``, in its ``put``): its handler
validates them and prices them in tokens, and those past the model's share of ``max_in_flight`` are refused.

This runs in the poll thread, once per fetch and model, before the batcher, so that a bad request is answered at once
and never takes a place in a batch, and so that the batcher knows each request's cost (``Handler.cost``) when it
groups requests by length under the token budget. Whatever the handler's hooks do, raise or return, each outcome is
its own request's: its neighbours and the poll thread go on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kinference.consumer.ledger.request import Request
from kinference.errors import RequestError
from kinference.handlers.base import Handler
from kinference.protocol import ErrorCode

log = logging.getLogger(__name__)

Answer = Callable[[list[Request]], None]
"""Hands finished requests on to be answered (``Publisher.submit``)."""


def let_go(requests: list[Request]) -> None:
    """Drop each request's decoded value and item: its runner calls this as it hands requests on to be answered,
    computed or refused. Their answers may wait for the broker a long while (an outage), and the byte budget no
    longer counts them by then."""
    for request in requests:
        request.payload = request.item = None

Admitted = tuple[Any, int | None]
"""An admitted request's item (what ``validate`` made of its payload) and its tokens (``cost``; None: not counted)."""


class Admission:
    """A model's admission of a fetch's requests (the poll thread), the first step of its runner's ``put``: its
    handler validates and prices them (``admit``), each request gets its ``item`` and ``tokens``, and those past
    the model's share of ``max_in_flight`` are refused ``overloaded``. A request refused here is answered at once."""

    def __init__(self, name: str, handler: Handler, answer: Answer, max_in_flight: int | None = None) -> None:
        """``max_in_flight``: with several models, the most requests this model may hold (``Runner.held``); None
        with one model, where flow control's pause is the only bound."""
        self.name = name
        self.handler = handler
        self._answer = answer
        self._max_in_flight = max_in_flight

    def put(self, requests: list[Request], held: int, queue: Answer) -> None:
        """Admit ``requests`` while the model holds ``held``, and hand those admitted to ``queue`` in one call (which
        takes all of them or, raising, none). Never raises: a request that cannot be queued (a bug) is answered
        ``internal_error``, its neighbours queued alone."""
        admitted = self._admitted(requests, held)
        if not admitted:
            return
        try:
            queue(admitted)
        except Exception:
            log.exception("model %s: queueing a fetch's requests failed; each is queued alone", self.name)
            for request in admitted:
                self._queue_alone(request, queue)

    def _admitted(self, requests: list[Request], held: int) -> list[Request]:
        room = None if self._max_in_flight is None else self._max_in_flight - held
        admitted: list[Request] = []
        refused: list[Request] = []
        for request, outcome in zip(requests, admit(self.handler, [request.payload for request in requests]),
                                    strict=True):
            if isinstance(outcome, RequestError):
                request.fail(outcome)
                refused.append(request)
            elif room is not None and len(admitted) >= room:
                request.fail(self._saturated(held + len(admitted)))
                refused.append(request)
            else:
                request.item, request.tokens = outcome
                admitted.append(request)
        if refused:
            let_go(refused)
            self._answer(refused)
        return admitted

    def _saturated(self, held: int) -> RequestError:
        return RequestError(f"model {self.name!r} is saturated: {held} of its requests are in flight, its share of "
                            "max_in_flight (--max-in-flight / number of models)", ErrorCode.OVERLOADED)

    def _queue_alone(self, request: Request, queue: Answer) -> None:
        try:
            queue([request])
        except Exception as exc:  # a bug: the record is tracked, so it must still be answered
            log.exception("model %s: queueing a request failed; it gets an internal_error reply", self.name)
            request.fail(RequestError(f"kinference could not route the request: {exc!r}", ErrorCode.INTERNAL_ERROR))
            let_go([request])
            self._answer([request])


def admit(handler: Handler, payloads: list[Any]) -> list[Admitted | RequestError]:
    """Each payload's outcome, in order: its item and tokens, or the error that refuses it. Never raises."""
    if not payloads:
        return []
    items = _contained(handler.validate_many, payloads)
    if not isinstance(items, list) or len(items) != len(payloads):
        # A bug in the batch hook (it raised, or miscounted): validate each payload alone, so that one bad payload
        # fails alone.
        items = [_contained(handler.validate, payload) for payload in payloads]
    return [_outcome(handler, item) for item in items]


def _outcome(handler: Handler, item: Any) -> Admitted | RequestError:
    if isinstance(item, RequestError):
        return item
    if isinstance(item, BaseException):  # a handler bug must fail this request, not the poll thread
        return RequestError(f"validate failed: {item!r}", ErrorCode.HANDLER_ERROR)
    tokens = _contained(handler.cost, item)
    if isinstance(tokens, BaseException):
        return RequestError(f"cost failed: {tokens!r}", ErrorCode.HANDLER_ERROR)
    # bool is an int subclass: True is not a token count.
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0):
        return RequestError(f"cost returned {tokens!r}; expected None or an int >= 0", ErrorCode.HANDLER_ERROR)
    return item, tokens


def _contained(hook: Callable[[Any], Any], argument: Any) -> Any:
    """``hook(argument)``, or what it raised. Anything but KeyboardInterrupt: a ``sys.exit`` in a handler's library
    must not end the poll thread."""
    try:
        return hook(argument)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        return exc
