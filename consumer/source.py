"""The source: the poll thread that owns the Kafka consumer.

It alone calls the consumer (librdkafka consumers are not to be shared across threads): it polls
records, decodes them into ``Request`` values, registers them with the commit tracker and routes
them on; it pauses partitions when too much is in flight and resumes them below the low-water mark;
it commits on an interval, on partition revoke and on close. Because this thread never runs the
model, a slow model can never make the consumer miss ``max.poll.interval.ms``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import orjson
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from kinference.consumer.commit import OffsetTracker, PartitionKey
from kinference.consumer.config import ServiceConfig
from kinference.consumer.metrics import Metrics
from kinference.consumer.request import Request, RequestDecoder

log = logging.getLogger(__name__)

_POLL_S = 0.05
_ERROR_BACKOFF_S = 0.5


class Source:
    def __init__(
        self,
        config: ServiceConfig,
        decoder: RequestDecoder,
        tracker: OffsetTracker,
        route: Callable[[Request], None],
        discard: Callable[[list[PartitionKey]], list[Request]],
        metrics: Metrics,
        transaction_commit: Callable[[float], bool] | None = None,
        consumer_factory: Callable[[dict[str, Any]], Any] = Consumer,
    ) -> None:
        """``route`` takes every decoded request; ``discard`` removes the not-yet-started requests of
        partitions being revoked (the batcher's waiting room). With ``transaction_commit``
        (exactly-once) offsets are committed by the publisher's transactions, never by the consumer:
        on revoke and close the source asks for one and waits for it."""
        self._config = config
        self._decoder = decoder
        self._tracker = tracker
        self._route = route
        self._discard = discard
        self._metrics = metrics
        self._transaction_commit = transaction_commit
        self._consumer = consumer_factory(
            {**config.consumer_config(), "error_cb": self._on_client_error, "stats_cb": self._on_stats}
        )
        self._thread = threading.Thread(target=self._run, name="kinference-source", daemon=True)
        self._draining = threading.Event()
        self._closing = threading.Event()
        self.assigned = threading.Event()
        self.paused = False
        self.broker_up = False
        """Some broker connection is up (librdkafka statistics; also set by a successful assignment)."""
        self._group_metadata: Any = None
        self._next_commit = 0.0

    def start(self) -> None:
        self._consumer.subscribe(
            list(self._config.request_topics),
            on_assign=self._on_assign,
            on_revoke=self._on_revoke,
            on_lost=self._on_lost,
        )
        self._thread.start()

    def drain(self) -> None:
        """Stop taking new records (partitions pause) but keep the group membership and commits."""
        self._draining.set()

    def close(self, timeout_s: float = 30.0) -> None:
        """Commit what is answered, leave the group and close the consumer."""
        self._closing.set()
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        try:
            while not self._closing.is_set():
                try:
                    self._poll_once()
                except KafkaException as exc:
                    log.error("consumer error: %s", exc)
                    time.sleep(_ERROR_BACKOFF_S)
                except Exception:
                    log.exception("poll loop error; continuing")
                    time.sleep(_ERROR_BACKOFF_S)
        finally:
            self._commit(final=True)
            self._consumer.close()
            log.info("consumer closed")

    def _poll_once(self) -> None:
        records = self._fetch()
        received = time.monotonic()
        for record in records:
            if record.error() is not None:
                self._on_record_error(record.error())
                continue
            request = self._decoder.decode(record, received)
            if self._tracker.track(request):
                self._route(request)
            else:
                log.debug("dropped %s/%d/%d: partition not owned, or already consumed", request.topic,
                          request.partition, request.offset)
        self._flow_control()
        if time.monotonic() >= self._next_commit:
            self._commit()
            self._update_lag()

    def _fetch(self) -> list[Any]:
        """Whatever is ready, up to ``max_poll_records``, without waiting for a full set: ``consume(n, t)``
        holds until n records or t seconds, which would add t to every request at low load. So: take
        what is queued; if nothing is, wait for one record and then take what came with it."""
        limit = self._config.max_poll_records
        records = self._consumer.consume(limit, 0)
        if records:
            return records
        first = self._consumer.poll(_POLL_S)
        if first is None:
            return []
        return [first, *self._consumer.consume(limit - 1, 0)] if limit > 1 else [first]

    def _flow_control(self) -> None:
        in_flight = self._tracker.in_flight
        self._metrics.in_flight.set(in_flight)
        if not self.paused and (self._draining.is_set() or in_flight >= self._config.max_in_flight):
            assignment = self._consumer.assignment()
            self._consumer.pause(assignment)
            self.paused = True
            self._metrics.paused_partitions.set(len(assignment))
            log.debug("paused: %d in flight", in_flight)
        elif self.paused and not self._draining.is_set() and in_flight <= self._config.resume_threshold:
            assignment = self._consumer.assignment()
            self._consumer.resume(assignment)
            # librdkafka notices a resume only at its next fetch-loop wake-up (about 1 s later); a seek
            # to the position the application has consumed up to starts the fetch at once, and refetches
            # exactly what pause() discarded.
            for tp in self._consumer.position(assignment):
                if tp.offset >= 0:
                    self._consumer.seek(tp)
            self.paused = False
            self._metrics.paused_partitions.set(0)
            log.debug("resumed: %d in flight", in_flight)

    def group_metadata(self) -> Any:
        """The consumer's group generation at the last assignment, for ``send_offsets_to_transaction``
        (zombie fencing). Cached by the poll thread: asking the consumer from another thread blocks
        while the poll thread is inside the consumer."""
        return self._group_metadata

    def _commit(self, partitions: list[PartitionKey] | None = None, final: bool = False) -> None:
        self._next_commit = time.monotonic() + self._config.commit_interval_ms / 1000
        if self._transaction_commit is not None:
            if final:
                self._transaction_commit(self._config.rebalance_drain_ms / 1000)
            return
        offsets = self._tracker.commit_offsets(partitions)
        if not offsets:
            return
        try:
            self._consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as exc:
            # Nothing is lost: the same offsets (or later ones) are committed next time.
            self._metrics.commit_failures.inc()
            log.warning("commit of %d partitions failed: %s", len(offsets), exc)
            return
        self._metrics.commits.inc()
        self._tracker.committed(offsets)

    def _update_lag(self) -> None:
        """Lag from the consumer's own state: no extra broker request (watermarks come with fetches)."""
        for tp in self._consumer.position(self._consumer.assignment()):
            if tp.offset < 0:
                continue  # nothing consumed from it yet: position unknown
            _low, high = self._consumer.get_watermark_offsets(tp, cached=True)
            if high >= 0:
                self._metrics.consumer_lag.labels(tp.topic, str(tp.partition)).set(max(0, high - tp.offset))

    def _on_assign(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        keys = [(tp.topic, tp.partition) for tp in partitions]
        self._tracker.assign(keys)
        consumer.assign(partitions)
        self._group_metadata = consumer.consumer_group_metadata()
        if self.paused:
            consumer.pause(partitions)
            self._metrics.paused_partitions.set(len(partitions))
        self._metrics.assigned_partitions.set(len(partitions))
        self.broker_up = True
        log.info("assigned %s", _names(keys))
        self.assigned.set()

    def _on_revoke(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        """Hand revoked partitions over cleanly: drop what has not started (the next owner serves
        it), give started work a bounded time to be answered, commit, then forget the partitions."""
        keys = [(tp.topic, tp.partition) for tp in partitions]
        self._tracker.abandon(self._discard(keys))
        if not self._tracker.wait_idle(self._config.rebalance_drain_ms / 1000, keys):
            log.warning("revoke: in-flight requests of %s not answered within %d ms; "
                        "the next owner may answer them again", _names(keys), self._config.rebalance_drain_ms)
        self._commit(keys, final=True)
        self._forget(keys)
        log.info("revoked %s", _names(keys))

    def _on_lost(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        """Partitions taken away without a clean revoke: another member owns them already, so
        committing would be wrong. Drop everything that has not started."""
        keys = [(tp.topic, tp.partition) for tp in partitions]
        self._discard(keys)
        self._forget(keys)
        log.warning("lost %s", _names(keys))

    def _forget(self, keys: list[PartitionKey]) -> None:
        self._tracker.revoke(keys)
        self.assigned.clear()
        self._metrics.assigned_partitions.set(0)
        self._metrics.paused_partitions.set(0)
        for topic, partition in keys:
            with contextlib.suppress(KeyError):  # a partition never measured has no series
                self._metrics.consumer_lag.remove(topic, str(partition))

    def _on_record_error(self, error: KafkaError) -> None:
        if error.code() == KafkaError._PARTITION_EOF:
            return
        log.error("consume error: %s", error)

    def _on_client_error(self, error: KafkaError) -> None:
        if error.code() == KafkaError._ALL_BROKERS_DOWN:
            self.broker_up = False
        log.log(logging.CRITICAL if error.fatal() else logging.WARNING, "consumer: %s", error)

    def _on_stats(self, stats_json: str) -> None:
        brokers = orjson.loads(stats_json).get("brokers", {})
        self.broker_up = any(broker.get("state") == "UP" for broker in brokers.values())


def _names(keys: list[PartitionKey]) -> str:
    return ", ".join(f"{topic}[{partition}]" for topic, partition in keys) or "nothing"
