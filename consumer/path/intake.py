"""Intake: one fetch's records into requests, for either source (``source`` for consumer groups, ``share`` for
share groups).

In passes over the fetch, its records in order: track them all (``Tracker``: the commit ledger,
``ledger.commit.OffsetTracker``, or the share ledger, ``ledger.share.ShareLedger``; one lock for the fetch) before
anything that can fail, decode each with its ledger (``request.RequestDecoder``: a record that cannot be read becomes
a request with an error, never an exception), then hand the fetch's requests to the models in one call
(``models.Models.take``: each model's runner admits its own together, the handler validating and pricing them in one
call for all). Whatever a record does, the intake goes on with the next one.

Decoding is where a request takes its memory, so a record is decoded only while the byte budget has room for one
more like those seen (``ledger.budget``): the rest of a fetch waits, tracked (so no commit passes it) and raw, and is
decoded first on a later turn, as answers give bytes back. Without it, two 900 KB Avro records that each hold 180 MB
decoded, in one fetch, took a service with a 256 MiB budget past it by one record.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kinference.consumer.ledger.budget import ByteBudget
from kinference.consumer.ledger.request import Request
from kinference.consumer.path.request import RequestDecoder
from kinference.consumer.types import PartitionKey

if TYPE_CHECKING:
    from kinference.consumer.path.models import Models

log = logging.getLogger(__name__)

class Tracker(Protocol):
    """The ledger each record is tracked in, as the intake sees it: a consumer group's commit ledger
    (``ledger.commit.OffsetTracker``) or a share group's (``ledger.share.ShareLedger``)."""

    def track_fetch(self, records: Sequence[tuple[PartitionKey, int]]) -> Sequence[Any]:
        """Each record's ledger, in order; None for one not to be served (its partition is not this member's)."""


class Intake:
    """What the source does with each fetch. The source reaches the rest of the service only through it, and
    ``discard`` on revoke."""

    def __init__(self, decoder: RequestDecoder, tracker: Tracker, models: Models,
                 budget: ByteBudget | None = None) -> None:
        """``budget`` is charged what each request holds decoded (``ledger.budget.ByteBudget``; by default one
        without a bound)."""
        self.budget = budget or ByteBudget.unbounded()
        self._tracker = tracker
        self._decoder = decoder
        self._models = models
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
            if (record.topic(), record.partition()) in partitions:
                taken.append(self._decoder.undecoded(record, ledger))
            else:
                kept.append((record, ledger))
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
        ledgers = self._tracker.track_fetch([((record.topic(), record.partition()), record.offset())
                                             for record in consumed])
        for record, ledger in zip(consumed, ledgers, strict=True):
            if ledger is None:
                log.debug("dropped %s[%d] offset %d: partition not owned", record.topic(), record.partition(),
                          record.offset())
            else:
                self._waiting.append((record, ledger))
        requests = self._decoded(received)
        self.budget.charge(requests)
        if requests:
            self._models.take(requests)

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
            request = decode(record, received, ledger)  # never raises: a bad record is a request with an error
            requests.append(request)
            next_bytes = request.held_bytes
            charged += next_bytes
        return requests
