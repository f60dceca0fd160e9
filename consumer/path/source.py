"""The source: the poll thread that owns the Kafka consumer.

It alone calls the consumer (a librdkafka consumer is not to be shared across threads). Each turn of its loop:

1. fetch what is ready (``_fetch``);
2. take in the records (``intake``), in passes over the fetch: track them with the commit tracker before anything
   that can fail, decode them (a record that cannot be read becomes a dead letter, never an exception), and hand
   the fetch's requests to their models' runners, one call per model, which admit them (``admission``: the handler
   validates and prices them, one call for all); whatever a record does, the loop goes on with the next one; then
   tell the ledger how far the consumer has gone (offsets it passed without handing a record over are gaps:
   transaction markers, aborted records, compaction; ``commit``);
3. the delivery mode's turn on this thread (``ledger.commits``; at-least-once, ``OffsetCommits``: commit what is
   answered; exactly-once, where offsets go into transactions, ``TransactionCommits``: read the group's generation
   for them);
4. pause or resume the partitions for flow control (``flow``).

Rebalances run inside ``consume()`` (``rebalance``). Because this thread never runs the model, a slow model
can never make the consumer miss ``max.poll.interval.ms``. A fatal consumer error (for example
``FENCED_INSTANCE_ID`` with static membership) ends the loop: ``fatal`` is set and the service exits non-zero.

A share group (``group_type=share``) has a source of its own: ``share.ShareSource``. The service sees either
through one protocol (``MemberSource``), and both run their poll thread with one lifecycle (``PollLoop``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import orjson
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from kinference.consumer.config import ServiceConfig
from kinference.consumer.ledger.commit import OffsetTracker
from kinference.consumer.ledger.commits import Commits
from kinference.consumer.ops.metrics import Metrics
from kinference.consumer.path.flow import FlowControl
from kinference.consumer.path.intake import Intake
from kinference.consumer.path.rebalance import Rebalance

log = logging.getLogger(__name__)

_POLL_S = 0.05
_ERROR_BACKOFF_S = 0.5


def is_fatal(error: KafkaError) -> bool:
    """Whether a consumer error ends the member. A fatal error that a fetch carries (static membership fenced by a
    newer instance) comes as code ``_FATAL`` with ``fatal()`` false: seen on Apache Kafka, where the member then
    served on as a zombie instead of exiting."""
    return error.fatal() or error.code() == KafkaError._FATAL


class ConsumerErrors:
    """What a consumer's errors mean for the member, for either source (this one and ``share.ShareSource``): a
    fatal one ends it (``fatal``: the poll loop stops and the service exits 1), and losing every broker clears
    ``broker_up`` (readiness). librdkafka calls ``on_client`` (its ``error_cb``) from the poll thread; a fetch's
    errors come to ``on_record``."""

    def __init__(self, metrics: Metrics, client: str) -> None:
        self._fatal_errors = metrics.fatal_errors.labels("consumer")
        self._client = client
        self.broker_up = False
        """Some broker connection is up (librdkafka statistics; also set by a successful fetch or assignment)."""
        self.fatal: KafkaError | None = None

    def on_record(self, error: KafkaError) -> None:
        if error.code() == KafkaError._PARTITION_EOF:
            return
        if is_fatal(error):
            self.on_client(error)
            return
        log.error("%s: consume error: %s", self._client, error)

    def on_client(self, error: KafkaError) -> None:
        if error.code() == KafkaError._ALL_BROKERS_DOWN:
            self.broker_up = False
        if is_fatal(error):
            self.fatal = error
            self._fatal_errors.inc()
            log.critical("%s fatal error: %s; stopping", self._client, error)
            return
        log.warning("%s: %s", self._client, error)


def poll_until_closed(poll_once: Callable[[], None], closing: threading.Event, errors: ConsumerErrors) -> None:
    """Turn a poll loop until ``closing`` is set or a fatal error came; a turn that raises never ends it."""
    while not closing.is_set() and errors.fatal is None:
        try:
            poll_once()
        except KafkaException as exc:
            errors.on_client(exc.args[0])
            time.sleep(_ERROR_BACKOFF_S)
        except Exception:
            log.exception("poll loop error; continuing")
            time.sleep(_ERROR_BACKOFF_S)


class MemberSource(Protocol):
    """A group member's source as the service sees it, either kind: this module's ``Source`` (a consumer group) or
    ``share.ShareSource`` (a share group). Started last, drained first at shutdown, closed by a deadline."""

    errors: ConsumerErrors

    @property
    def joined(self) -> threading.Event:
        """Set once the member is in its group."""

    @property
    def alive(self) -> bool:
        """The poll thread runs and no fatal consumer error came."""

    @property
    def paused(self) -> bool:
        """No new records are taken (flow control, or draining)."""

    def start(self) -> None: ...

    def drain(self, timeout_s: float) -> None:
        """Stop taking new records; return once the poll thread paused for good (within ``timeout_s``)."""

    def close(self, deadline: float) -> None:
        """Make what is answered durable, leave the group and close the consumer, by ``deadline`` (monotonic)."""


class PollLoop:
    """The poll thread's lifecycle, the same for both sources: turn ``poll_once`` until ``close`` or a fatal
    error, then ``finish`` (make what is answered durable, close the consumer) on the same thread, which alone
    calls the consumer. The source sets ``paused_for_good`` when its loop takes no new record any more; ``drain``
    waits for that."""

    def __init__(self, name: str, errors: ConsumerErrors, poll_once: Callable[[], None],
                 finish: Callable[[], None]) -> None:
        self.errors = errors
        self.closing = threading.Event()
        self.paused_for_good = threading.Event()
        self._poll_once = poll_once
        self._finish = finish
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wait_paused(self, timeout_s: float) -> None:
        if self._thread.is_alive() and not self.paused_for_good.wait(timeout_s):
            log.warning("shutdown: the poll thread did not pause within %.1f s", timeout_s)

    def close(self, deadline: float) -> None:
        self.closing.set()
        self._thread.join(max(0.0, deadline - time.monotonic()))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.errors.fatal is None

    def _run(self) -> None:
        try:
            poll_until_closed(self._poll_once, self.closing, self.errors)
        finally:
            self._finish()


class Source:
    def __init__(
        self,
        config: ServiceConfig,
        intake: Intake,
        tracker: OffsetTracker,
        commits: Commits,
        metrics: Metrics,
        consumer_factory: Callable[[dict[str, Any]], Any] = Consumer,
    ) -> None:
        """``intake`` takes each poll's records in, tracked by the commit ledger ``tracker``; ``commits``, the
        delivery mode's poll-thread side, commits what is answered of them, and its ``in_flight`` is what flow
        control bounds."""
        self._config = config
        self._intake = intake
        self._tracker = tracker
        self._commits = commits
        self.errors = ConsumerErrors(metrics, "consumer")
        self._budget = intake.budget
        self._flow = FlowControl(config.max_in_flight, config.resume_threshold, metrics, intake.budget)
        self.rebalance = Rebalance(config, intake, tracker, self._flow, commits, metrics)
        callbacks = {"error_cb": self.errors.on_client, "stats_cb": self._on_stats, **commits.consumer_callbacks()}
        self._consumer = consumer_factory({**config.consumer_config(), **callbacks})
        self._loop = PollLoop("kinference-source", self.errors, self._poll_once, self._close_consumer)

    def start(self) -> None:
        self._consumer.subscribe(list(self._config.request_topics), on_assign=self._on_assign,
                                 on_revoke=self.rebalance.on_revoke, on_lost=self.rebalance.on_lost)
        self._loop.start()

    def drain(self, timeout_s: float) -> None:
        """Stop taking new records (partitions pause) but keep the group membership and commits. Returns once the
        poll thread has paused, so that every record it took is tracked (in flight) by then."""
        self._flow.draining = True
        self._loop.wait_paused(timeout_s)

    def close(self, deadline: float) -> None:
        """Commit what is answered, leave the group and close the consumer, by ``deadline`` (monotonic). By then
        the stages and the publisher have stopped: nothing more can be answered, so the revoke that leaving the
        group runs commits at once instead of waiting for in-flight requests."""
        self.rebalance.drain_until = time.monotonic()
        self._loop.close(deadline)

    @property
    def alive(self) -> bool:
        return self._loop.alive

    @property
    def paused(self) -> bool:
        return self._flow.paused

    @property
    def joined(self) -> threading.Event:
        """Set once the member is in the group (its first assignment, even of no partitions)."""
        return self.rebalance.joined

    # --- the poll thread

    def _close_consumer(self) -> None:
        if self.errors.fatal is None:
            self._commits.commit(self._consumer)
        self._consumer.close()  # leaves the group: the partitions move to other members at once
        log.info("consumer closed")

    def _poll_once(self) -> None:
        self._take_in(self._fetch())
        self._commits.turn(self._consumer, time.monotonic())
        self._flow.update(self._consumer, self._commits.in_flight)
        if self._flow.draining and self._flow.paused:
            self._loop.paused_for_good.set()

    def _fetch(self) -> list[Any]:
        """Whatever is ready, up to ``max_poll_records``, without waiting for a full set: ``consume(n, t)``
        holds until n records or t seconds, which would add t to every request at low load. So: take
        what is queued; if nothing is, wait for one record and then take what came with it."""
        limit = self._budget.records_allowed(self._config.max_poll_records)
        records: list[Any] = self._consumer.consume(limit, 0)
        if records:
            return records
        first = self._consumer.poll(_POLL_S)
        if first is None:
            return []
        return [first, *self._consumer.consume(limit - 1, 0)] if limit > 1 else [first]

    def _take_in(self, records: list[Any]) -> None:
        self._intake.take(records, self.errors.on_record)
        self._follow_positions()

    def _follow_positions(self) -> None:
        """Every record the consumer handed over is tracked by now: its positions say which offsets it passed
        without handing a record over. Read for every partition each turn (a local call): a transaction's marker
        can come in a fetch of its own, long after the transaction's records."""
        partitions = [TopicPartition(topic, partition) for topic, partition in self._tracker.partitions()]
        if partitions:
            self._tracker.passed([((tp.topic, tp.partition), tp.offset) for tp in self._consumer.position(partitions)
                                  if tp.offset >= 0])

    def _on_assign(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        self.errors.broker_up = True
        self.rebalance.on_assign(consumer, partitions)

    def _on_stats(self, stats_json: str) -> None:
        brokers = orjson.loads(stats_json).get("brokers", {})
        self.errors.broker_up = any(broker.get("state") == "UP" for broker in brokers.values())
