"""Intake: one fetch's records into requests, for either source (``source`` for consumer groups, ``share`` for
share groups).

In passes over the fetch, its records in order: track them all (``ledger.commit.OffsetTracker``, or
``ledger.share.ShareLedger``; one lock for the fetch) before anything that can fail, decode each (a record that
cannot be read becomes a request with an error, never an exception), then admit the fetch's readable requests
together (the handler validates and prices them, one call for all) and route each on. Whatever a record does, the
intake goes on with the next one.

Decoding is where a request takes its memory, so a record is decoded only while the byte budget has room for one
more like those seen (``ledger.budget``): the rest of a fetch waits, tracked (so no commit passes it) and raw, and is
decoded first on a later turn, as answers give bytes back. Without it, two 900 KB Avro records that each hold 180 MB
decoded, in one fetch, took a service with a 256 MiB budget past it by one record.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from kinference.consumer.ledger.budget import ByteBudget
from kinference.consumer.ledger.request import Request
from kinference.consumer.ops.logs import about
from kinference.consumer.path.request import RequestDecoder
from kinference.consumer.types import PartitionKey
from kinference.errors import RequestError
from kinference.protocol import ErrorCode

if TYPE_CHECKING:
    from kinference.consumer.ledger.commit import OffsetTracker
    from kinference.consumer.ledger.share import ShareLedger
    from kinference.consumer.ops.tracing import Tracing
    from kinference.consumer.path.models import Models

log = logging.getLogger(__name__)

TrackerT = TypeVar("TrackerT", "OffsetTracker", "ShareLedger")
"""The ledger each record is tracked in: a consumer group's commit ledger or a share group's."""


class Intake(Generic[TrackerT]):
    """What the source does with each fetch. The source reaches the rest of the service only through it: the
    ``tracker`` it commits from, and ``discard`` on revoke."""

    def __init__(self, decoder: RequestDecoder, tracker: TrackerT, models: Models,
                 tracing: Tracing | None = None, budget: ByteBudget | None = None) -> None:
        """``tracing``, when on, starts each request's span. ``budget`` is charged what each request holds decoded
        (``ledger.budget.ByteBudget``; by default one without a bound)."""
        self.tracker: TrackerT = tracker
        self.budget = budget or ByteBudget.unbounded()
        self._decoder = decoder
        self._models = models
        self._tracing = tracing
        self._waiting: deque[tuple[Any, Any]] = deque()
        """Tracked records not decoded yet, in the order consumed, each with its ledger: the budget had no room."""

    @property
    def waiting(self) -> int:
        """Records tracked and left undecoded until the budget has room."""
        return len(self._waiting)

    def discard(self, partitions: list[PartitionKey]) -> list[Request]:
        """The requests of revoked partitions that no model has started on, taken back; with those of their records
        still waiting to be decoded (as requests that hold nothing but their coordinates and ledger)."""
        discarded = self._models.discard(partitions)
        self.budget.release(discarded)
        return discarded + self._taken_back(set(partitions))

    def _taken_back(self, partitions: set[PartitionKey]) -> list[Request]:
        kept: deque[tuple[Any, Any]] = deque()
        taken = []
        for record, ledger in self._waiting:
            topic, partition, offset = record.topic(), record.partition(), record.offset()
            if (topic, partition) not in partitions:
                kept.append((record, ledger))
                continue
            request = Request(topic=topic, partition=partition, offset=offset, key=None, value=None, headers=[],
                              received=time.monotonic(), correlation_id=f"{topic}/{partition}/{offset}",
                              reply_topic="")
            request.ledger = ledger
            taken.append(request)
        self._waiting = kept
        return taken

    def take(self, records: list[Any], on_error: Callable[[Any], None]) -> None:
        """Take in one fetch's records, in passes over the fetch; ``on_error`` gets each consume error it carried."""
        received = time.monotonic()
        consumed = []
        for record in records:
            error = record.error()
            if error is None:
                consumed.append(record)
            else:
                on_error(error)
        # Every record tracked first, one lock for the fetch: reading its coordinates cannot fail.
        ledgers = self.tracker.track_fetch([((record.topic(), record.partition()), record.offset())
                                            for record in consumed])
        for record, ledger in zip(consumed, ledgers, strict=True):
            if ledger is None:
                log.debug("dropped %s[%d] offset %d: partition not owned", record.topic(), record.partition(),
                          record.offset())
            else:
                self._waiting.append((record, ledger))
        requests = self._decoded(received)
        self.budget.charge(requests)
        if self._tracing is not None:
            self._tracing.received(requests)
        self._models.admit([request for request in requests if request.ok])
        for request in requests:
            self._take(request)
        self._models.wake()

    def _decoded(self, received: float) -> list[Request]:
        """The waiting records decoded, in order, while the budget has room for one more like the last decoded (at
        first, like the budget's mean). One is decoded while nothing is held, so that a request larger than the whole
        budget is still served, alone."""
        budget, waiting, decode = self.budget, self._waiting, self._decoder.decode
        room = budget.max_bytes - budget.held
        next_bytes, charged = budget.mean, 0
        requests: list[Request] = []
        while waiting and (charged + next_bytes <= room or (not requests and budget.held == 0)):
            record, ledger = waiting.popleft()
            request = decode(record, received)  # never raises: a bad record is a request with an error
            request.ledger = ledger
            requests.append(request)
            next_bytes = request.held_bytes
            charged += next_bytes
        return requests

    def _take(self, request: Request) -> None:
        """Route one tracked request. Nothing it does may leave the loop: the requests after it in this fetch must
        still be routed."""
        try:
            self._models.route(request)
        except Exception as exc:  # a bug: the record is tracked, so it must still be answered
            log.exception("routing a request failed; it gets an internal_error reply", extra=about(request))
            request.fail(RequestError(f"kinference could not route the request: {exc!r}", ErrorCode.INTERNAL_ERROR))
            try:
                self._models.answer_now(request)
            except Exception:
                log.critical("the request cannot be answered; it stays in flight and is never acknowledged past",
                             exc_info=True, extra=about(request))
