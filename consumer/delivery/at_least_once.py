"""At-least-once (``--delivery at-least-once``, the default): a request is answered once the broker acknowledged
every record that answers it, and its offset is committed by the consumer, on the poll thread, once every record
before it is answered too (``ledger.commit``, the ledger, keeps that rule).

The mode has the same two sides as exactly-once (``exactly_once``), each entered from one thread:

- on the publisher thread, ``AtLeastOnce`` (this module): the records that answer the requests the publisher took in
  a turn are produced in that turn; when every record of a request is acknowledged (or given up on: unanswerable),
  the request is answered, and handed to its ledger (``ledger.commit.OffsetTracker.finish``; a share group's
  ``ledger.share.ShareLedger``, whose source acknowledges it instead of committing). A record refused for a passing
  reason is produced again after a backoff (the publisher's retries), one refused for good is replaced at once, and
  a producer that failed for good is replaced (``replaces_producer``): an idempotent producer can be, with no one to
  fence;
- on the poll thread, ``ledger.commits.OffsetCommits``, on the floor below, where the source reaches it: an
  asynchronous commit of the positions that moved, every ``commit_interval_ms``; a synchronous one on revoke and at
  close.
A generative request's stream chunks (``streams``) are produced as they come, before its final, best effort: they
are not tracked, since the final is what answers the request.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from confluent_kafka import KafkaError

from kinference.consumer.delivery.answers import Delivery, InFlight, Record, Settled, StreamChunk, answer_all
from kinference.consumer.ledger.commit import Ledger
from kinference.consumer.ledger.request import Request
from kinference.errors import RequestError

log = logging.getLogger(__name__)


class AtLeastOnce:
    """The publisher's side of at-least-once, entered from the publisher thread (and ``close`` from the thread that
    stops the publisher too). Each turn of the publisher: ``take`` the finished requests, ``begin`` (their records,
    to produce now), the reports (``delivered``, ``refused``), then ``end`` (the answered ones to their ledger)."""

    replaces_producer = True
    """A producer that failed for good is replaced: what it did not deliver is produced again by a new one."""

    streams = True
    """A generative request's stream chunks are produced as they come, before its final."""

    def __init__(self, ledger: Ledger, dead_letter_topic: str) -> None:
        self._ledger = ledger
        self._dead_letter_topic = dead_letter_topic
        self._taken: list[Request] = []
        self._misdirected: dict[Request, RequestError] = {}
        """Taken requests whose reply partition does not exist (``answers.ReplyPartitions``), with their error."""
        self._outstanding: dict[Request, int] = {}
        """Records not yet acknowledged of each request."""
        self._answered: list[Request] = []
        """Answered since the last hand-over to the ledger."""
        self._errors: dict[Request, RequestError] = {}
        """The delivery's outcome of requests not answered yet whose records answer with an error not their own
        (``Delivery.error``); rare, so that an ok answer costs no look-up."""
        self._failed: dict[Request, RequestError] = {}
        """Answered since the last hand-over, with an error their records gave them (see ``_errors``)."""
        self._landed: list[Delivery] = []
        self._closed = False

    def take(self, requests: list[Request], misdirected: dict[Request, RequestError] | None = None) -> None:
        """Finished requests (results or errors): answered in this turn; ``misdirected``, those whose reply partition
        does not exist, with their error."""
        self._taken += requests
        if misdirected:
            self._misdirected.update(misdirected)

    def stream(self, chunks: Sequence[StreamChunk]) -> list[Record]:
        """Every chunk, produced now, best effort: not tracked for the commit (its request's final answers it)."""
        return [piece.record for piece in chunks]

    def begin(self, _producer: Any, now: float, _final: bool) -> list[Delivery]:
        """The records that answer the requests taken this turn: the publisher produces them now."""
        taken, self._taken = self._taken, []
        misdirected, self._misdirected = self._misdirected, {}
        deliveries = answer_all(taken, self._dead_letter_topic, now, misdirected)
        outstanding = self._outstanding
        for delivery in deliveries:
            request = delivery.request
            outstanding[request] = outstanding.get(request, 0) + 1
        return deliveries

    def delivered(self, delivery: Delivery) -> None:
        self._landed.append(delivery)
        request = delivery.request
        if self._outstanding.get(request) == 1 and delivery.error is None and not self._errors:
            # The common case in one step: the request's last record, and no error of the delivery's to settle.
            del self._outstanding[request]
            self._answered.append(request)
            return
        self._settle(delivery)

    def refused(self, delivery: Delivery, _error: KafkaError, replacements: list[Delivery] | None,
                _at_once: bool) -> list[Delivery] | None:
        """None for a record refused for a passing reason: the publisher produces it again after a backoff. For one
        refused for good, ``replacements`` answer its request in its place, produced at once (none: the request is
        answered without it, unanswerable)."""
        if replacements is None:
            return None
        request = delivery.request
        if request in self._outstanding:
            self._outstanding[request] += len(replacements)
        self._settle(delivery)
        return replacements

    def end(self, _producer: Any, _in_flight: InFlight) -> Settled:
        """Hand the requests answered since the last turn to their ledger: the consumer commits their offsets."""
        answered, self._answered = self._answered, []
        landed, self._landed = self._landed, []
        failed, self._failed = self._failed, {}
        if answered:
            self._ledger.finish(answered, failed)
        return Settled(answered, landed, errors=failed)

    def close(self) -> None:
        """The publisher leaves: what is still unanswered stays uncommitted, and is served again after a restart."""
        if self._outstanding and not self._closed:
            log.warning("%d requests were still unanswered at shutdown; their offsets stay uncommitted",
                        len(self._outstanding))
        self._closed = True

    def _settle(self, delivery: Delivery) -> None:
        """One record of its request is done with (delivered, or given up on)."""
        request = delivery.request
        left = self._outstanding.get(request)
        if left is None:
            return  # given up on already (unanswerable)
        if delivery.error is not None:
            self._errors.setdefault(request, delivery.error)  # the first error stays, as ``Request.fail`` keeps it
        if left > 1:
            self._outstanding[request] = left - 1
            return
        del self._outstanding[request]
        self._answered.append(request)
        if self._errors and (error := self._errors.pop(request, None)) is not None:
            self._failed[request] = error
