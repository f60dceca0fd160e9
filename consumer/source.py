"""The source: the poll thread that owns the Kafka consumer.

It alone calls the consumer (librdkafka consumers are not to be shared across threads): it polls
records, decodes them into ``Request`` values, registers them with the commit tracker and routes
them on; it pauses partitions when too much is in flight and resumes them below the low-water mark;
it commits on an interval, on partition revoke and on close. Because this thread never runs the
model, a slow model can never make the consumer miss ``max.poll.interval.ms``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from consumer.commit import OffsetTracker, PartitionKey
from consumer.config import ServiceConfig
from consumer.protocol import Request, RequestDecoder

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
        consumer_factory: Callable[[dict[str, Any]], Any] = Consumer,
    ) -> None:
        """``route`` takes every decoded request; ``discard`` removes the not-yet-started requests of
        partitions being revoked (the batcher's waiting room)."""
        self._config = config
        self._decoder = decoder
        self._tracker = tracker
        self._route = route
        self._discard = discard
        self._consumer = consumer_factory({**config.consumer_config(), "error_cb": self._on_client_error})
        self._thread = threading.Thread(target=self._run, name="kinfer-source", daemon=True)
        self._draining = threading.Event()
        self._closing = threading.Event()
        self.assigned = threading.Event()
        self.paused = False
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
            self._commit()
            self._consumer.close()
            log.info("consumer closed")

    def _poll_once(self) -> None:
        records = self._consumer.consume(self._config.max_poll_records, _POLL_S)
        received = time.monotonic()
        for record in records:
            if record.error() is not None:
                self._on_record_error(record.error())
                continue
            request = self._decoder.decode(record, received)
            self._tracker.track(request)
            self._route(request)
        self._flow_control()
        if time.monotonic() >= self._next_commit:
            self._commit()

    def _flow_control(self) -> None:
        in_flight = self._tracker.in_flight
        if not self.paused and (self._draining.is_set() or in_flight >= self._config.max_in_flight):
            self._consumer.pause(self._consumer.assignment())
            self.paused = True
            log.debug("paused: %d in flight", in_flight)
        elif self.paused and not self._draining.is_set() and in_flight <= self._config.resume_threshold:
            self._consumer.resume(self._consumer.assignment())
            self.paused = False
            log.debug("resumed: %d in flight", in_flight)

    def _commit(self, partitions: list[PartitionKey] | None = None) -> None:
        self._next_commit = time.monotonic() + self._config.commit_interval_ms / 1000
        offsets = self._tracker.commit_offsets(partitions)
        if not offsets:
            return
        try:
            self._consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as exc:
            # Nothing is lost: the same offsets (or later ones) are committed next time.
            log.warning("commit of %d partitions failed: %s", len(offsets), exc)
            return
        self._tracker.committed(offsets)

    def _on_assign(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        keys = [(tp.topic, tp.partition) for tp in partitions]
        self._tracker.assign(keys)
        consumer.assign(partitions)
        if self.paused:
            consumer.pause(partitions)
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
        self._commit(keys)
        self._tracker.revoke(keys)
        self.assigned.clear()
        log.info("revoked %s", _names(keys))

    def _on_lost(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        """Partitions taken away without a clean revoke: another member owns them already, so
        committing would be wrong. Drop everything that has not started."""
        keys = [(tp.topic, tp.partition) for tp in partitions]
        self._discard(keys)
        self._tracker.revoke(keys)
        self.assigned.clear()
        log.warning("lost %s", _names(keys))

    def _on_record_error(self, error: KafkaError) -> None:
        if error.code() == KafkaError._PARTITION_EOF:
            return
        log.error("consume error: %s", error)

    def _on_client_error(self, error: KafkaError) -> None:
        log.log(logging.CRITICAL if error.fatal() else logging.WARNING, "consumer: %s", error)


def _names(keys: list[PartitionKey]) -> str:
    return ", ".join(f"{topic}[{partition}]" for topic, partition in keys) or "nothing"
