"""The publisher: one thread owns the producer, produces what answers each finished request, and follows every
record until the broker has it. Its delivery mode (``DeliveryMode``: ``at_least_once.AtLeastOnce`` or
``exactly_once.ExactlyOnce``) says which records to produce when, and when a request counts as answered; everything
in which the modes differ is there, and this module knows nothing of transactions.

Each turn of the publisher's loop, in order:

1. take finished requests from the inbox. A reply partition the reply topic lacks answers its request with
   ``bad_request`` on the default partition (``answers.ReplyPartitions``). The delivery mode takes them (``take``);
2. produce again the records refused for a passing reason whose backoff is over;
3. serve the delivery reports: each record's is handed to the delivery mode (``delivered``, ``refused``);
4. produce what the delivery mode says is due (``begin``: at-least-once, the answers of the requests taken in step
   1; exactly-once, when a transaction is due, its records), then let it settle (``end``: at-least-once hands the
   requests answered to their ledger, exactly-once commits the transaction). Those answered now end their spans,
   and their records are counted.

A record the broker refuses (``answers.classify``):

- for good (too large, unknown topic...): the request is answered another way (``answers.replacement``), when the
  delivery mode says (at once; exactly-once: in the same transaction or the next);
- for a passing reason (a timeout during a broker outage, a purge): the same record is produced again, with
  backoff, for up to ``delivery_retry_timeout_s`` (exactly-once: in the next transaction);
- because the producer itself failed for good (the idempotent producer's sequence lost), or when no delivery
  succeeded for longer than librdkafka's own delivery timeout while records are outstanding: where the
  delivery mode allows it (``replaces_producer``), the producer is replaced and every record it did not report as
  delivered is produced again by the new one, whatever the old one may still report later (stale, ignored). A
  replaced producer loses its de-duplication, which is why an ordinary stall (a leader election) is never
  reason enough. Where the delivery mode does not allow it, the service stops.

No record can stop the service: a request that nothing can answer (the broker refused its reply and its dead letter
for good, even without the original value and headers) is unanswerable, an outcome of its own. It is counted
(``kinference_unanswerable_requests``) and logged with its coordinates, and it counts as answered: its offset is
committed past, since producing the same records again would be refused again, on every start. A record refused
for a passing reason past ``delivery_retry_timeout_s`` is not the record's doing (the broker is away): then
``failure`` is set, ``/healthz`` fails and the service exits non-zero, so that the orchestrator restarts it, and the
request, uncommitted, is served again.

Every record has a delivery callback of its own, although confluent-kafka builds a ``Message`` (a copy of the
value) and takes the GIL again for each report: the largest per-record cost of this thread (issue 27). A callback
on the last record of each partition's run only, the earlier ones taken as delivered by the order, would not be
safe. The idempotent producer keeps the order of what it writes, but it can still fail one record and write the
ones after it: a record that timed out (``message.timeout.ms``) before it was sent, or a batch the broker refused
for good (too large for the topic, invalid), after which librdkafka bumps the producer epoch and goes on. A record
without a callback fails silently, and its offset would be committed with nothing answering it.
``enable.gapless.guarantee`` (experimental) makes such a gap fatal, but not a timeout, and a fatal error without
the failed record named would replace the producer over and over for one reply too large for its topic;
``delivery.report.only.error`` reports no success at all.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from collections import Counter as Tally
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from confluent_kafka import KafkaError, KafkaException, Producer

from kinference.consumer.config import ServiceConfig
from kinference.consumer.delivery.answers import (
    Delivery,
    InFlight,
    Record,
    Refusal,
    ReplyPartitions,
    Settled,
    StreamChunk,
    classify,
    replacement,
)
from kinference.consumer.ledger.budget import ByteBudget
from kinference.consumer.ledger.request import Request
from kinference.consumer.ops.logs import about
from kinference.consumer.ops.metrics import UNSERVED_LABEL, Metrics, observe_many
from kinference.errors import RequestError
from kinference.protocol import ErrorCode

if TYPE_CHECKING:
    from kinference.consumer.ops.tracing import Tracing

log = logging.getLogger(__name__)

_POLL_S = 0.05
_PUT_S = 0.5
_BACKOFF_S = (0.5, 30.0)
"""First and longest wait before a record refused for a passing reason is produced again."""
_REPLACED_FLUSH_S = 1.0
"""How long a replaced producer may report on what it holds; whatever it has not reported by then is produced
again by the new one."""
_METADATA_TIMEOUT_S = 2.0


class PublisherDown(RuntimeError):
    """The publisher thread is not running: finished requests have nowhere to go."""


def observe(metrics: Metrics, requests: list[Request], misdirected: dict[Request, RequestError], now: float) -> None:
    """Per-request metrics, taken when the requests reach the publisher: one update per metric and label set for
    all of them. A micro-batch's requests share their model and topic (the common case: its labels are looked up
    once, and each request costs a subtraction); others are grouped by label set first. ``misdirected``: the
    requests answered with the error of a missing reply partition (``answers.ReplyPartitions``)."""
    if not requests:
        return
    first = requests[0]
    model, topic = first.model, first.topic
    groups = ([requests] if all(request.model is model and request.topic == topic for request in requests)
              else _by_labels(requests))
    for group in groups:
        _observe_group(metrics, group, misdirected, now)


def _by_labels(requests: list[Request]) -> list[list[Request]]:
    groups: dict[tuple[Any, str], list[Request]] = {}
    for request in requests:
        groups.setdefault((request.model, request.topic), []).append(request)
    return list(groups.values())


def _observe_group(metrics: Metrics, requests: list[Request], misdirected: dict[Request, RequestError],
                   now: float) -> None:
    """``observe`` for requests of one model and topic."""
    first = requests[0]
    labels = (first.model.name if first.model is not None else UNSERVED_LABEL, first.topic)
    codes = Tally(str(error.code) for error in (request.error or (misdirected.get(request) if misdirected else None)
                                                for request in requests) if error is not None)
    ok = len(requests) - sum(codes.values())
    if ok:
        codes["ok"] = ok
    for code, count in codes.items():
        metrics.labelled(metrics.requests, *labels, code).inc(count)
    observe_many(metrics.labelled(metrics.service_seconds, *labels), [now - request.received for request in requests])
    observe_many(metrics.labelled(metrics.queue_wait, *labels),
                 [request.dispatched - request.received for request in requests if request.dispatched is not None])


class DeliveryMode(Protocol):
    """The publisher thread's side of a delivery mode, as the publisher calls it each turn: either mode
    (``at_least_once.AtLeastOnce``, ``exactly_once.ExactlyOnce``), never asked which."""

    @property
    def replaces_producer(self) -> bool:
        """Whether a producer that failed for good may be replaced (else the service stops)."""

    def take(self, requests: list[Request], misdirected: dict[Request, RequestError] | None = None) -> None:
        """Finished requests (results or errors), from the inbox; ``misdirected``: those whose reply partition does
        not exist, with the error that answers them (``answers.ReplyPartitions.check``)."""

    def begin(self, producer: Any, now: float, final: bool) -> list[Delivery]:
        """The records to produce now (``final``: the last turn before stopping)."""

    @property
    def streams(self) -> bool:
        """Whether a generative request's stream chunks are produced at all (else only its final)."""

    def stream(self, chunks: Sequence[StreamChunk]) -> list[Record]:
        """The records of stream chunks to produce now, best effort."""

    def delivered(self, delivery: Delivery) -> None: ...

    def refused(self, delivery: Delivery, error: KafkaError, replacements: list[Delivery] | None,
                at_once: bool) -> list[Delivery] | None:
        """What to produce now in place of a refused record; None: produce it again after a backoff."""

    def end(self, producer: Any, in_flight: InFlight) -> Settled:
        """What this turn answered for good."""

    def close(self) -> None:
        """The publisher leaves."""


_Entry = Callable[[], None]
"""An inbox entry: what the publisher thread does with it, bound to the finished requests (``Publisher.submit``) or the
stream chunks (``Publisher.stream``) it carries, so that the thread never asks which of the two it took."""


@dataclass(frozen=True)
class PublishSettings:
    """The publisher's part of the service's settings."""

    dead_letter_topic: str
    queue_size: int
    """The most batches of finished requests waiting for the publisher thread."""
    delivery_retry_timeout_s: float = 600.0
    """How long a record refused for a passing reason is produced again."""
    stall_timeout_s: float = 330.0
    """No successful delivery for this long, with records outstanding: the producer is replaced (or the service
    stops)."""
    max_in_flight_bytes: int = 2**63
    """The bound of ``Publisher.budget``: what the requests in flight may hold decoded."""

    @classmethod
    def of(cls, config: ServiceConfig) -> PublishSettings:
        # Everything in flight fits in the queue, so the poll thread never waits on it.
        return cls(config.dead_letter_topic, config.max_in_flight + config.max_poll_records,
                   config.delivery_retry_timeout_s, config.stall_timeout_s, config.max_in_flight_bytes)


class Publisher:
    def __init__(
        self,
        producer_config: dict[str, str],
        delivery: DeliveryMode,
        settings: PublishSettings,
        metrics: Metrics,
        *,
        producer_factory: Callable[[dict[str, Any]], Any] = Producer,
        tracing: Tracing | None = None,
    ) -> None:
        """``producer_config`` carries ``transactional.id`` for exactly-once. ``tracing``, when on, ends each
        request's span once the request is answered."""
        self._metrics = metrics
        self._tracing = tracing
        self._dead_letter_topic = settings.dead_letter_topic
        self._delivery = delivery
        self.budget = ByteBudget(settings.max_in_flight_bytes)
        """What the requests in flight hold decoded: the intake charges it, ``submit`` releases it (the stages are
        done with them), and the source's flow control bounds it."""
        self._inbox: queue.Queue[_Entry] = queue.Queue(maxsize=settings.queue_size)
        self._new_producer = partial(producer_factory, {**producer_config, "error_cb": self._on_client_error})
        self._producer = self._new_producer()
        self._reply_partitions = ReplyPartitions(self._partitions)
        self._retry_timeout_s = settings.delivery_retry_timeout_s
        self._stall_timeout_s = settings.stall_timeout_s
        self._in_flight = InFlight()
        """Records produced and not reported on; its epoch moves on when a producer is replaced (or the delivery
        mode voids what it produced): reports of records produced before are stale."""
        self._retries: list[tuple[float, int, Delivery]] = []
        """Refused records waiting to be produced again: a heap by due time."""
        self._order = itertools.count()
        self._fatal: KafkaError | None = None
        self._last_success = time.monotonic()
        self._successes = 0
        """Records delivered, ever: ``_stalled`` reads the clock once a turn, not each report."""
        self._successes_seen = 0
        self._settled = False
        """The last turn found the service stopping with nothing left in the inbox, and made durable what it could."""
        self.failure: str | None = None
        """Why the publisher cannot go on; set once, then the service stops with a non-zero exit."""
        self._stopping = threading.Event()
        self._abandon = threading.Event()
        """Set when the stop deadline passed: leave now, whatever is still outstanding."""
        self._thread = threading.Thread(target=self._run, name="kinference-publisher", daemon=True)

    # --- lifecycle (any thread)

    def start(self) -> None:
        self._thread.start()

    def submit(self, requests: list[Request]) -> None:
        """Queue finished requests (results or errors), from the stages or answered at once; the byte budget gives
        back what it charged for them (their runner has let their decoded values go). The queue holds everything in
        flight, so this only waits if the publisher fell behind; it raises ``PublisherDown`` rather than wait for a
        dead thread."""
        self.budget.release(requests)
        self._put(partial(self._take_finished, requests))

    def stream(self, chunks: Sequence[StreamChunk]) -> None:
        """Queue the stream chunks of generative requests, produced (as the delivery mode says: ``streams``) in order
        before their requests' finals (one producer, one partition per request). Chunks are not answers: nothing
        waits for their acknowledgement."""
        self._put(partial(self._take_chunks, chunks))

    @property
    def streams(self) -> bool:
        """Whether stream chunks are produced at all: the delivery mode's (``DeliveryMode.streams``)."""
        return self._delivery.streams

    def reply_partitions(self, topic: str) -> int | None:
        """The reply topic's partition count (``answers.ReplyPartitions``, cached), for a generative model's keyless
        streams: any thread (the cache's entries are replaced whole)."""
        return self._reply_partitions.count(topic)

    def _put(self, entry: _Entry) -> None:
        while True:
            try:
                self._inbox.put(entry, timeout=_PUT_S)
                return
            except queue.Full:
                if not self.alive:
                    raise PublisherDown(f"the publisher is not running ({self.failure or 'stopped'})") from None

    def stop(self, timeout_s: float) -> None:
        """Publish what is queued and wait up to ``timeout_s`` for it to become durable."""
        self._stopping.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._abandon.set()
            self._delivery.close()  # a call the delivery mode retries in the thread gives up
            self._thread.join(_POLL_S * 4)
        if not self._thread.is_alive():
            # The producer holds our callbacks (a reference cycle): drop it now so librdkafka's threads and
            # connections end with the service, not at some later garbage collection.
            self._producer = None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # --- the publisher thread

    def _run(self) -> None:
        try:
            while not self._done():
                self._check_producer()
                self._take(self._wait_s())  # 1
                self._retry_due(time.monotonic())  # 2
                self._producer.poll(0)  # 3
                self._settle(time.monotonic())  # 4
        except Exception as exc:
            self._fail(f"the publisher failed: {exc!r}")
            log.critical("publisher thread failed", exc_info=True)
        finally:
            self._delivery.close()

    def _done(self) -> bool:
        if self.failure is not None or self._abandon.is_set():
            return True
        return self._settled and (not self._outstanding() or self._fatal is not None)

    def _outstanding(self) -> bool:
        """Records not yet delivered: produced and not reported on, or waiting out a backoff."""
        return bool(self._in_flight.records or self._retries)

    def _wait_s(self) -> float:
        due = self._retries[0][0] - time.monotonic() if self._retries else _POLL_S
        return max(0.0, min(_POLL_S, due))

    def _take(self, timeout_s: float) -> None:
        try:
            entry = self._inbox.get(timeout=timeout_s)
        except queue.Empty:
            return
        entry()

    def _take_finished(self, requests: list[Request]) -> None:
        misdirected = self._reply_partitions.check(requests)
        observe(self._metrics, requests, misdirected, time.monotonic())
        self._delivery.take(requests, misdirected)

    def _take_chunks(self, chunks: Sequence[StreamChunk]) -> None:
        self._produce_chunks(self._delivery.stream(chunks))

    def _retry_due(self, now: float) -> None:
        while self._retries and self._retries[0][0] <= now:
            _, _, delivery = heapq.heappop(self._retries)
            self._send(delivery)

    def _settle(self, now: float) -> None:
        final = self._stopping.is_set() and self._inbox.empty()
        self._send_all(self._delivery.begin(self._producer, now, final))
        settled = self._delivery.end(self._producer, self._in_flight)
        if settled.failure is not None:
            self._fail(settled.failure)
        self._count(settled.landed)
        if settled.answered and self._tracing is not None:
            self._tracing.answered(settled.answered, settled.errors)  # each span ends: it counts as answered
        self._settled = final

    # --- records

    def _produce_chunks(self, records: list[Record]) -> None:
        """Best effort: a chunk the broker refuses is counted and logged, and the client sees the gap (the final,
        which carries the whole text, is what answers the request)."""
        for topic, value, key, headers, partition in records:
            kwargs = {} if partition is None else {"partition": partition}
            while True:
                try:
                    self._producer.produce(topic, value, key, headers=headers, on_delivery=self._on_chunk, **kwargs)
                    break
                except BufferError:
                    self._producer.poll(_POLL_S)
                except KafkaException as exc:
                    self._on_chunk(exc.args[0], None)
                    break

    def _on_chunk(self, error: KafkaError | None, _message: Any) -> None:
        if error is not None:
            self._metrics.labelled(self._metrics.delivery_failures, "chunk").inc()
            log.warning("a stream chunk was not delivered: %s", error)

    def _send_all(self, deliveries: list[Delivery]) -> None:
        """``_send`` each of a turn's records, in one pass: what is the same for all of them (the producer, the
        report callback, the epoch) is looked up once. Only the report stays per record (see the module)."""
        produce, report, in_flight = self._producer.produce, self._on_delivery, self._in_flight
        records, epoch = in_flight.records, in_flight.epoch
        for place, delivery in enumerate(deliveries):
            topic, value, key, headers, partition = delivery.record
            delivery.attempts += 1
            try:
                if partition is None:
                    produce(topic, value, key, headers=headers, on_delivery=partial(report, delivery))
                else:
                    produce(topic, value, key, headers=headers, on_delivery=partial(report, delivery),
                            partition=partition)
            except (BufferError, KafkaException):
                # librdkafka's queue is full, or it refused the record at once: the careful path, one by one.
                delivery.attempts -= 1
                for rest in deliveries[place:]:
                    self._send(rest)
                return
            delivery.epoch = epoch
            records[delivery] = None

    def _send(self, delivery: Delivery) -> None:
        topic, value, key, headers, partition = delivery.record
        kwargs = {} if partition is None else {"partition": partition}
        delivery.attempts += 1
        while True:
            try:
                self._producer.produce(topic, value, key, headers=headers,
                                       on_delivery=partial(self._on_delivery, delivery), **kwargs)
                self._in_flight.add(delivery)
                return
            except BufferError:
                # librdkafka's local queue is full: serve delivery reports until there is room.
                self._producer.poll(_POLL_S)
            except KafkaException as exc:
                # Refused at once (too large, unknown topic or partition...): never entered the producer's queue.
                self._refused(delivery, exc.args[0], at_once=True)
                return

    def _on_delivery(self, delivery: Delivery, error: KafkaError | None, _message: Any) -> None:
        """A record's delivery report: the one piece of Python work each record costs this thread on success."""
        in_flight = self._in_flight
        if delivery.epoch != in_flight.epoch:
            return  # stale: produced again since, by a new producer, or in a transaction that aborted
        if error is None:
            del in_flight.records[delivery]
            self._successes += 1
            self._delivery.delivered(delivery)
            return
        if self._fatal is not None or error.fatal():
            self._fatal = self._fatal or error  # it stays in flight: the next producer produces it again
            return
        del in_flight.records[delivery]
        self._refused(delivery, error, at_once=False)

    def _refused(self, delivery: Delivery, error: KafkaError, *, at_once: bool) -> None:
        refusal = classify(error)
        if refusal is Refusal.FATAL or self._fatal is not None:
            self._fatal = self._fatal or error
            self._in_flight.add(delivery)
            return
        self._metrics.labelled(self._metrics.delivery_failures, delivery.kind).inc()
        replacements = None
        if refusal is Refusal.PERMANENT:
            log.error("%s to %s refused: %s", delivery.kind.replace("_", " "), delivery.record[0], error,
                      extra=about(delivery.request))
            replacements = self._replacements(delivery, error)
        resend = self._delivery.refused(delivery, error, replacements, at_once)
        if resend is None:
            self._retry_later(delivery, error)
            return
        for replacing in resend:
            self._send(replacing)

    def _replacements(self, refused: Delivery, error: KafkaError) -> list[Delivery]:
        """What answers the request instead (``answers.replacement``). When nothing can replace a record the broker
        refused for good, the request is answered without it (by its other record, or by none), counted and logged,
        and its offset committed past (see the module)."""
        deliveries = replacement(refused, error, self._dead_letter_topic, time.monotonic())
        if deliveries:
            return deliveries
        request = refused.request
        self._metrics.unanswerable.inc()
        # The delivery's outcome, not the request's: its mode settles it with this error (``Delivery.outcome``).
        refused.error = refused.error or RequestError(f"unanswerable: {refused.record[0]} refused the "
                                                      f"{refused.kind.replace('_', ' ')}: {error.str()}",
                                                      ErrorCode.INTERNAL_ERROR)
        log.error("unanswerable request: %s refused its %s (%s) and nothing smaller can replace it; it is committed "
                  "past without it", refused.record[0], refused.kind.replace("_", " "), error, extra=about(request))
        return deliveries

    def _retry_later(self, delivery: Delivery, error: KafkaError) -> None:
        now = time.monotonic()
        if now - delivery.first_attempt > self._retry_timeout_s:
            self._unanswerable(delivery.request, f"{delivery.kind.replace('_', ' ')} to {delivery.record[0]} still "
                               f"failed after {self._retry_timeout_s:g} s: {error}")
            return
        backoff = min(_BACKOFF_S[1], _BACKOFF_S[0] * 2 ** (delivery.attempts - 1))
        log.warning("%s to %s failed (%s); producing it again in %.1f s", delivery.kind.replace("_", " "),
                    delivery.record[0], error, backoff, extra=about(delivery.request))
        heapq.heappush(self._retries, (now + backoff, next(self._order), delivery))

    def _count(self, landed: list[Delivery]) -> None:
        """The records that count as delivered this turn, by kind, added to the metrics once per turn."""
        if not landed:
            return
        for kind, count in Tally([delivery.counts_as for delivery in landed]).items():
            if kind == "dead_letter":
                self._metrics.dead_letters.inc(count)
            else:
                self._metrics.labelled(self._metrics.replies, kind).inc(count)

    def _unanswerable(self, request: Request, why: str) -> None:
        """The broker stayed away past the retry bound: stop, and the request is served again after a restart."""
        self._fail(f"a request cannot be answered ({why}); its offset stays uncommitted")
        log.critical("cannot answer the request: %s; stopping", why, extra=about(request))

    def _fail(self, why: str) -> None:
        if self.failure is None:
            self.failure = why

    def _partitions(self, topic: str) -> int | None:
        """The topic's partition count, from the producer's metadata; None if the broker does not say."""
        try:
            metadata = self._producer.list_topics(topic, timeout=_METADATA_TIMEOUT_S).topics.get(topic)
        except KafkaException as exc:
            log.warning("no metadata for reply topic %s: %s", topic, exc)
            return None
        if metadata is None or metadata.error is not None:
            return None
        return len(metadata.partitions)

    # --- a producer that failed for good

    def _check_producer(self) -> None:
        if self._fatal is None and self._stalled():
            self._fatal = KafkaError(KafkaError._TIMED_OUT, f"no successful delivery for {self._stall_timeout_s:g} s "
                                     f"with {len(self._producer)} records outstanding")
        if self._fatal is None:
            return
        if not self._delivery.replaces_producer:
            raise KafkaException(self._fatal)
        self._replace_producer()

    def _stalled(self) -> bool:
        """No successful delivery for the stall timeout while records wait for one: the producer hands out
        records but nothing lands (after a broker lost its state, librdkafka's idempotent producer can fail
        every record without ever raising a fatal error)."""
        if not self._outstanding() or self._successes != self._successes_seen:
            self._successes_seen = self._successes
            self._last_success = time.monotonic()
            return False
        return time.monotonic() - self._last_success > self._stall_timeout_s

    def _replace_producer(self) -> None:
        log.warning("replacing the producer: %s", self._fatal)
        old = self._producer
        # Fail what the dead producer still holds, and take what it reports now. Whatever it has not reported as
        # delivered by then stays in flight and is produced again below; a report it gives later is stale.
        old.purge(in_queue=True, in_flight=True, blocking=False)
        old.flush(_REPLACED_FLUSH_S)
        self._producer = self._new_producer()
        self._fatal = None
        self._last_success = time.monotonic()
        self._metrics.producer_replacements.inc()
        # Records waiting out a backoff go at once: the producer they failed on is gone.
        undelivered = [*self._in_flight.void(), *(delivery for _, _, delivery in sorted(self._retries))]
        self._retries = []
        for delivery in undelivered:
            self._send(delivery)
        log.warning("new producer: %d records produced again", len(undelivered))

    def _on_client_error(self, error: KafkaError) -> None:
        if error.fatal():
            self._fatal = error
            self._metrics.labelled(self._metrics.fatal_errors, "producer").inc()
            log.error("producer fatal error: %s", error)
        else:
            log.warning("producer: %s", error)
