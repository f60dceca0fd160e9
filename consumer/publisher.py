"""The publisher: one thread owns the producer, produces what answers each finished request, and follows
every record until the broker has it.

This is the at-least-once publisher; ``transactions.TransactionalPublisher`` is the exactly-once one, and
both share everything here: the inbox and the thread, what answers a request and what replaces a refused
record (``answers``), how a refusal is classified, the metrics, and what stops the service. They differ
only where their guarantees differ:

- here, a request counts as answered once the broker acknowledged each of its records; ``on_answered``
  then hands it to the commit tracker (all those of one turn of the thread's loop at once), and the consumer
  commits its offset later;
- a record refused for a passing reason (a timeout during a broker outage, a purge) is produced again with
  backoff, for up to ``delivery_retry_timeout_s``; past that the request is unanswerable;
- a producer with a fatal error (the idempotent producer's sequence lost), or with no successful delivery for
  longer than librdkafka's own delivery timeout while records are outstanding, is replaced, and what it had
  not delivered is produced again by the new one. A replaced producer loses its de-duplication, which is
  why an ordinary stall (a leader election) is never reason enough.

An unanswerable request (its dead letter refused for good, or transient failures past the bound) is never
marked answered, so its offset is never committed; ``failure`` is set, ``/healthz`` fails, and the service
exits non-zero so that the orchestrator restarts it.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from confluent_kafka import KafkaError, KafkaException, Producer

from kinference.consumer.answers import Delivery, Refusal, answer, classify, replacement
from kinference.consumer.logs import about
from kinference.consumer.metrics import Metrics
from kinference.consumer.request import Request
from kinference.consumer.router import NO_MODEL

if TYPE_CHECKING:
    from kinference.consumer.tracing import Tracing

log = logging.getLogger(__name__)

_POLL_S = 0.05
_PUT_S = 0.5
_BACKOFF_S = (0.5, 30.0)
"""First and longest wait before a record refused for a passing reason is produced again."""


class PublisherDown(RuntimeError):
    """The publisher thread is not running: finished requests have nowhere to go."""


def observe(metrics: Metrics, request: Request, now: float) -> None:
    """Per-request metrics, taken when the request reaches the publisher."""
    outcome = "ok" if request.error is None else str(request.error.code)
    model = request.model.name if request.model is not None else NO_MODEL
    metrics.labelled(metrics.requests, model, request.topic, outcome).inc()
    metrics.labelled(metrics.service_seconds, model, request.topic).observe(now - request.received)
    if request.dispatched is not None:
        metrics.labelled(metrics.queue_wait, model, request.topic).observe(request.dispatched - request.received)


class Publisher:
    def __init__(
        self,
        producer_config: dict[str, str],
        dead_letter_topic: str,
        on_answered: Callable[[list[Request]], None],
        queue_size: int,
        metrics: Metrics,
        *,
        delivery_retry_timeout_s: float = 600.0,
        stall_timeout_s: float = 330.0,
        producer_factory: Callable[[dict[str, Any]], Any] = Producer,
        tracing: Tracing | None = None,
    ) -> None:
        """``tracing``, when on, ends each request's span once the request is answered."""
        self._metrics = metrics
        self._tracing = tracing
        self._dead_letter_topic = dead_letter_topic
        self._on_answered = on_answered
        self._inbox: queue.Queue[list[Request]] = queue.Queue(maxsize=queue_size)
        self._new_producer = partial(producer_factory, {**producer_config, "error_cb": self._on_client_error})
        self._producer = self._new_producer()
        self._retry_timeout_s = delivery_retry_timeout_s
        self._stall_timeout_s = stall_timeout_s
        self._outstanding: dict[Request, int] = {}
        """Records of each request not yet acknowledged."""
        self._answered: list[Request] = []
        """Answered since the last hand-over to ``on_answered``."""
        self._retries: list[tuple[float, int, Delivery]] = []
        """Refused records waiting to be produced again: a heap by due time."""
        self._order = itertools.count()
        self._fatal: KafkaError | None = None
        self._undelivered: list[Delivery] = []
        """Records a dead producer failed, to produce again with the next one."""
        self._last_success = time.monotonic()
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
        """Queue finished requests (results or errors). The queue holds everything in flight, so this only
        waits if the publisher fell behind; it raises ``PublisherDown`` rather than wait for a dead thread."""
        while True:
            try:
                self._inbox.put(requests, timeout=_PUT_S)
                return
            except queue.Full:
                if not self.alive:
                    raise PublisherDown(f"the publisher is not running ({self.failure or 'stopped'})") from None

    def stop(self, timeout_s: float) -> None:
        """Publish what is queued and wait up to ``timeout_s`` for the broker's acknowledgements."""
        self._stopping.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._abandon.set()
            self._thread.join(_POLL_S * 4)
        if self._outstanding:
            log.warning("%d requests were still unanswered at shutdown; their offsets stay uncommitted",
                        len(self._outstanding))
        if not self._thread.is_alive():
            # The producer holds our callbacks (a reference cycle): drop it now so librdkafka's threads and
            # connections end with the service, not at some later garbage collection.
            self._producer = None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def held(self) -> int:
        """Answered requests whose offsets wait for something other than the consumer's commit (none here)."""
        return 0

    # --- the publisher thread

    def _run(self) -> None:
        try:
            self._open()
            while not self._done():
                self._check_producer()
                self._take(self._wait_s())
                self._tick(time.monotonic())
                self._producer.poll(0)
                self._hand_over()
        except Exception as exc:
            self._fail(f"the publisher failed: {exc!r}")
            log.critical("publisher thread failed", exc_info=True)

    def _open(self) -> None:
        """Make the producer ready (the transactional one registers its id)."""

    def _done(self) -> bool:
        if self.failure is not None or self._abandon.is_set():
            return True
        if not self._stopping.is_set() or not self._inbox.empty():
            return False
        return not self._outstanding or self._fatal is not None

    def _wait_s(self) -> float:
        due = self._retries[0][0] - time.monotonic() if self._retries else _POLL_S
        return max(0.0, min(_POLL_S, due))

    def _take(self, timeout_s: float) -> None:
        try:
            requests = self._inbox.get(timeout=timeout_s)
        except queue.Empty:
            return
        now = time.monotonic()
        for request in requests:
            observe(self._metrics, request, now)
        self._accept(requests, now)

    def _accept(self, requests: list[Request], now: float) -> None:
        """At-least-once: answer at once."""
        for request in requests:
            self._answer(request, answer(request, self._dead_letter_topic, now))

    def _tick(self, now: float) -> None:
        """Produce again the refused records that are due."""
        while self._retries and self._retries[0][0] <= now:
            _, _, delivery = heapq.heappop(self._retries)
            self._send(delivery)

    def _answer(self, request: Request, deliveries: list[Delivery]) -> None:
        self._outstanding[request] = self._outstanding.get(request, 0) + len(deliveries)
        for delivery in deliveries:
            self._send(delivery)

    def _send(self, delivery: Delivery) -> None:
        topic, value, key, headers, partition = delivery.record
        kwargs = {} if partition is None else {"partition": partition}
        delivery.attempts += 1
        while True:
            try:
                self._producer.produce(topic, value, key, headers=headers,
                                       on_delivery=partial(self._on_delivery, delivery), **kwargs)
                return
            except BufferError:
                # librdkafka's local queue is full: serve delivery reports until there is room.
                self._producer.poll(_POLL_S)
            except KafkaException as exc:
                # Refused at once (too large, unknown topic or partition...): the same path as a failed delivery.
                self._on_delivery(delivery, exc.args[0], None)
                return

    def _on_delivery(self, delivery: Delivery, error: KafkaError | None, _message: Any) -> None:
        if error is None:
            self._last_success = time.monotonic()
            self._delivered(delivery)
            return
        refusal = classify(error)
        if refusal is Refusal.FATAL or self._fatal is not None:
            self._fatal = self._fatal or error
            self._undelivered.append(delivery)
            return
        self._metrics.labelled(self._metrics.delivery_failures, delivery.kind).inc()
        if refusal is Refusal.TRANSIENT:
            self._refused_for_now(delivery, error)
            return
        log.error("%s to %s refused: %s", delivery.kind.replace("_", " "), delivery.record[0], error,
                  extra=about(delivery.request))
        self._replace(delivery, error)

    def _replace(self, delivery: Delivery, error: KafkaError) -> None:
        """Answer the request another way (``answers.replacement``)."""
        request = delivery.request
        self._outstanding[request] -= 1
        deliveries = replacement(delivery, error, self._dead_letter_topic, time.monotonic())
        if not deliveries:
            self._unanswerable(request, f"{delivery.record[0]} refused the dead letter: {error}")
            return
        self._answer(request, deliveries)

    def _refused_for_now(self, delivery: Delivery, error: KafkaError) -> None:
        now = time.monotonic()
        if now - delivery.first_attempt > self._retry_timeout_s:
            self._unanswerable(delivery.request, f"{delivery.kind.replace('_', ' ')} to {delivery.record[0]} still "
                               f"failed after {self._retry_timeout_s:g} s: {error}")
            return
        backoff = min(_BACKOFF_S[1], _BACKOFF_S[0] * 2 ** (delivery.attempts - 1))
        log.warning("%s to %s failed (%s); producing it again in %.1f s", delivery.kind.replace("_", " "),
                    delivery.record[0], error, backoff, extra=about(delivery.request))
        heapq.heappush(self._retries, (now + backoff, next(self._order), delivery))

    def _delivered(self, delivery: Delivery) -> None:
        request = delivery.request
        if delivery.kind == "reply":
            self._metrics.labelled(self._metrics.replies, "ok" if request.ok else "error").inc()
        else:
            self._metrics.dead_letters.inc()
        self._outstanding[request] -= 1
        if self._outstanding[request] == 0:
            del self._outstanding[request]
            self._answered.append(request)

    def _hand_over(self) -> None:
        if self._answered:
            answered, self._answered = self._answered, []
            self._trace_answered(answered)
            self._on_answered(answered)

    def _trace_answered(self, requests: list[Request]) -> None:
        """The end of each request's span: when it counts as answered, which differs between the delivery modes."""
        if self._tracing is not None:
            self._tracing.answered(requests)

    def _unanswerable(self, request: Request, why: str) -> None:
        self._outstanding.pop(request, None)
        self._fail(f"a request cannot be answered ({why}); its offset stays uncommitted")
        log.critical("cannot answer the request: %s; stopping", why, extra=about(request))

    def _fail(self, why: str) -> None:
        if self.failure is None:
            self.failure = why

    # --- a dead producer is replaced (at-least-once only)

    def _check_producer(self) -> None:
        if self._fatal is None and self._stalled():
            self._fatal = KafkaError(KafkaError._TIMED_OUT, f"no successful delivery for {self._stall_timeout_s:g} s "
                                     f"with {len(self._producer)} records outstanding")
        if self._fatal is not None:
            self._replace_producer()

    def _stalled(self) -> bool:
        """No successful delivery for the stall timeout while requests wait for one: the producer hands out
        records but nothing lands (after a broker lost its state, librdkafka's idempotent producer can fail
        every record without ever raising a fatal error)."""
        if not self._outstanding:
            self._last_success = time.monotonic()
            return False
        return time.monotonic() - self._last_success > self._stall_timeout_s

    def _replace_producer(self) -> None:
        log.warning("replacing the producer: %s", self._fatal)
        old = self._producer
        # Fail whatever the dead producer still holds; its delivery reports land in _undelivered.
        old.purge(in_queue=True, in_flight=True, blocking=False)
        old.flush(1.0)
        self._producer = self._new_producer()
        self._fatal = None
        self._last_success = time.monotonic()
        self._metrics.producer_replacements.inc()
        # Records waiting out a backoff go at once: the producer they failed on is gone.
        undelivered = self._undelivered + [delivery for _, _, delivery in self._retries]
        self._undelivered, self._retries = [], []
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
