"""Intake: one fetch's records into requests, for either source (``source`` for consumer groups, ``share`` for
share groups).

For each record, in order: track it (``commit.OffsetTracker``, or ``share.ShareLedger``) before anything that can
fail, decode it (a record that cannot be read becomes a request with an error, never an exception), then admit
the fetch's readable requests together (the handler validates and prices them, one call for all) and route each
on. Whatever a record does, the intake goes on with the next one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from kinference.consumer.logs import about
from kinference.consumer.request import Request, RequestDecoder
from kinference.errors import RequestError
from kinference.protocol import ErrorCode

if TYPE_CHECKING:
    from kinference.consumer.tracing import Tracing

log = logging.getLogger(__name__)

PartitionKey = tuple[str, int]


class Tracker(Protocol):
    def track(self, key: PartitionKey, offset: int) -> Any:
        """The record's ledger, or None when it is not to be served (not owned, or seen already)."""


class Intake:
    def __init__(
        self,
        decoder: RequestDecoder,
        tracker: Tracker,
        admit: Callable[[list[Request]], None],
        route: Callable[[Request], None],
        reject: Callable[[Request], None],
        tracing: Tracing | None = None,
    ) -> None:
        """``admit`` validates and prices the readable requests of one fetch and never raises; ``route`` takes each
        request on (to the batcher, or to an error reply); ``reject`` answers a request at once (an error reply);
        ``tracing``, when on, starts each request's span."""
        self._decoder = decoder
        self._tracker = tracker
        self._admit = admit
        self._route = route
        self._reject = reject
        self._tracing = tracing

    def take(self, records: list[Any], on_error: Callable[[Any], None]) -> dict[PartitionKey, int]:
        """Take in one fetch's records; ``on_error`` gets each consume error the fetch carried. Returns the next
        offset of each partition after the records it tracked."""
        received = time.monotonic()
        next_offsets: dict[PartitionKey, int] = {}
        requests = []
        for record in records:
            error = record.error()
            if error is not None:
                on_error(error)
                continue
            key, offset = (record.topic(), record.partition()), record.offset()
            ledger = self._tracker.track(key, offset)
            if ledger is None:
                log.debug("dropped %s[%d] offset %d: partition not owned, or already consumed", *key, offset)
                continue
            next_offsets[key] = offset + 1
            request = self._decoder.decode(record, received)  # never raises: a bad record is a request with an error
            request.ledger = ledger
            requests.append(request)
        if self._tracing is not None:
            self._tracing.received(requests)
        self._admit([request for request in requests if request.ok])
        for request in requests:
            self._take(request)
        return next_offsets

    def _take(self, request: Request) -> None:
        """Route one tracked request. Nothing it does may leave the loop: the requests after it in this fetch must
        still be routed."""
        try:
            self._route(request)
        except Exception as exc:  # a bug: the record is tracked, so it must still be answered
            log.exception("routing a request failed; it gets an internal_error reply", extra=about(request))
            request.fail(RequestError(f"kinference could not route the request: {exc!r}", ErrorCode.INTERNAL_ERROR))
            try:
                self._reject(request)
            except Exception:
                log.critical("the request cannot be answered; it stays in flight and is never acknowledged past",
                             exc_info=True, extra=about(request))
