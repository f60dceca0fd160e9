"""At-least-once (``--delivery at-least-once``, the default): a request is answered once the broker acknowledged
every record that answers it, and its offset is committed by the consumer, on the poll thread, once every record
before it is answered too (``commit``, the ledger, keeps that rule).

Everything in which this mode differs from exactly-once (``exactly_once``) is in this module:

- on the publisher thread, ``AtLeastOnce``: the records that answer the requests the publisher took in a turn are
  produced in that turn; when every record of a request is acknowledged (or given up on: unanswerable), the request
  is answered, and handed to its ledger (``commit.OffsetTracker.finish``; a share group's ``share.ShareLedger``,
  whose source acknowledges it instead of committing). A record refused for a passing reason is produced again after
  a backoff (the publisher's retries), one refused for good is replaced at once, and a producer that failed for
  good is replaced (``replaces_producer``): an idempotent producer can be, with no one to fence;
- on the poll thread, ``OffsetCommits``: an asynchronous commit of the positions that moved, every
  ``commit_interval_ms``; a synchronous one on revoke and at close.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from kinference.consumer.delivery.commit import OffsetTracker
from kinference.consumer.ops.metrics import Metrics
from kinference.consumer.path.answers import Delivery, InFlight, Settled, answer
from kinference.consumer.path.request import Request
from kinference.consumer.types import PartitionKey

if TYPE_CHECKING:  # share imports the source, which imports this module
    from kinference.consumer.path.share import ShareLedger

log = logging.getLogger(__name__)


class AtLeastOnce:
    """The publisher's side of at-least-once. Each turn of the publisher: ``take`` the finished requests, ``begin``
    (their records, to produce now), the reports (``delivered``, ``refused``), then ``end`` (the answered ones to
    their ledger)."""

    replaces_producer = True
    """A producer that failed for good is replaced: what it did not deliver is produced again by a new one."""

    def __init__(self, ledger: OffsetTracker | ShareLedger, dead_letter_topic: str) -> None:
        self._ledger = ledger
        self._dead_letter_topic = dead_letter_topic
        self._taken: list[Request] = []
        self._outstanding: dict[Request, int] = {}
        """Records not yet acknowledged of each request."""
        self._answered: list[Request] = []
        """Answered since the last hand-over to the ledger."""
        self._landed: list[Delivery] = []
        self._closed = False

    def take(self, requests: list[Request]) -> None:
        """Finished requests (results or errors): answered in this turn."""
        self._taken += requests

    def begin(self, _producer: Any, now: float, _final: bool) -> list[Delivery]:
        """The records that answer the requests taken this turn: the publisher produces them now."""
        taken, self._taken = self._taken, []
        deliveries = []
        for request in taken:
            answers = answer(request, self._dead_letter_topic, now)
            self._outstanding[request] = self._outstanding.get(request, 0) + len(answers)
            deliveries += answers
        return deliveries

    def delivered(self, delivery: Delivery) -> None:
        self._landed.append(delivery)
        self._settle(delivery.request)

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
        self._settle(request)
        return replacements

    def end(self, _producer: Any, _in_flight: InFlight) -> Settled:
        """Hand the requests answered since the last turn to their ledger: the consumer commits their offsets."""
        answered, self._answered = self._answered, []
        landed, self._landed = self._landed, []
        if answered:
            self._ledger.finish(answered)
        return Settled(answered, landed)

    def close(self) -> None:
        """The publisher leaves: what is still unanswered stays uncommitted, and is served again after a restart."""
        if self._outstanding and not self._closed:
            log.warning("%d requests were still unanswered at shutdown; their offsets stay uncommitted",
                        len(self._outstanding))
        self._closed = True

    def _settle(self, request: Request) -> None:
        """One record of ``request`` is done with (delivered, or given up on)."""
        left = self._outstanding.get(request)
        if left is None:
            return  # given up on already (unanswerable)
        if left > 1:
            self._outstanding[request] = left - 1
            return
        del self._outstanding[request]
        self._answered.append(request)


class OffsetCommits:
    """The poll thread's side of at-least-once: it commits the positions the ledger moved. A share group has none:
    its source acknowledges each record (``share.ShareSource``)."""

    def __init__(self, tracker: OffsetTracker, metrics: Metrics, interval_s: float) -> None:
        self._tracker = tracker
        self._metrics = metrics
        self._interval_s = interval_s
        self._next = 0.0
        self._waiting = False
        """An asynchronous commit is out: the next waits for its report, so that commits never pile up while the
        coordinator does not answer (a rebalance, a fail-over)."""

    @property
    def in_flight(self) -> int:
        """What flow control bounds: nothing waits here (a request is answered once acknowledged), so the ledger's."""
        return self._tracker.in_flight

    def turn(self, consumer: Any, now: float) -> None:
        """Each turn of the poll loop: commit asynchronously what the ledger moved, once per interval."""
        if now < self._next or self._waiting:
            return
        self._next = now + self._interval_s
        offsets = self._tracker.commit_offsets()
        if offsets:
            self._waiting = True
            consumer.commit(offsets=offsets, asynchronous=True)

    def commit(self, consumer: Any, partitions: list[PartitionKey] | None = None) -> None:
        """Revoke and close: commit what is answered of ``partitions`` (default: all) now, and wait."""
        offsets = self._tracker.commit_offsets(partitions)
        if not offsets:
            return
        try:
            result = consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as exc:
            # Nothing is lost: the next owner, or this member after a restart, serves them again.
            self._metrics.commit_failures.inc()
            log.warning("commit of %d partitions failed: %s", len(offsets), exc)
            return
        self._accepted(result or offsets)

    def on_commit(self, error: KafkaError | None, partitions: list[TopicPartition]) -> None:
        """librdkafka's report of an asynchronous commit (served by ``poll``, in the poll thread)."""
        self._waiting = False
        if error is not None:
            # Nothing is lost: the same offsets (or later ones) are committed next time.
            self._metrics.commit_failures.inc()
            log.warning("commit failed: %s", error)
            return
        self._accepted(partitions)

    def _accepted(self, partitions: list[TopicPartition]) -> None:
        accepted = [tp for tp in partitions if tp.error is None]
        if len(accepted) < len(partitions):
            self._metrics.commit_failures.inc()
        self._tracker.committed(accepted)
        self._metrics.commits.inc()
