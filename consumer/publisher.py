"""The publisher: produces each request's reply (and dead letter) and reports it answered.

One thread owns an idempotent producer. A request counts as answered only when the broker has
acknowledged every record produced for it (reply, plus a dead letter for records that were not
valid requests); then ``on_answered`` hands it to the commit tracker. A reply that cannot be
delivered (e.g. its reply topic does not exist) sends the request to the dead-letter topic instead;
if that fails too the request is never marked answered, so its offset is never committed and the
record is served again after a restart or rebalance (at-least-once).

A dead producer does not stop the service: it is replaced, and every record it had not delivered
is produced again by the new one. Dead means a fatal error, or no delivery report at all for
``stall_timeout_s`` while records are outstanding: after a broker lost its state, librdkafka's
idempotent producer can retry UNKNOWN_PRODUCER_ID forever without ever raising a fatal error.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer

from kinference.consumer.logs import about
from kinference.consumer.metrics import Metrics
from kinference.consumer.request import Request, dead_letter_headers, reply_headers, reply_value
from kinference.errors import RequestError
from kinference.protocol import ErrorCode

log = logging.getLogger(__name__)

_POLL_S = 0.05

_Record = tuple[str, bytes | None, bytes | None, list, int | None]
"""topic, value, key, headers, partition: what is needed to produce a record again."""


def reply_record(request: Request, now: float) -> _Record:
    return (request.reply_topic, reply_value(request), request.key, reply_headers(request, now),
            request.reply_partition)


def dead_letter_record(topic: str, request: Request, error: RequestError, original: bool = True) -> _Record:
    """With ``original`` the request's value and headers ride along; without, only kinference's headers."""
    return (topic, request.value if original else None, request.key,
            dead_letter_headers(request, error, original), None)


def observe(metrics: Metrics, request: Request, now: float) -> None:
    """Per-request metrics, taken when its reply is handed to the producer."""
    outcome = "ok" if request.error is None else str(request.error.code)
    metrics.requests.labels(request.topic, outcome).inc()
    metrics.service_seconds.labels(request.topic).observe(now - request.received)
    if request.dispatched is not None:
        metrics.queue_wait.labels(request.topic).observe(request.dispatched - request.received)


class Publisher:
    def __init__(
        self,
        producer_config: dict[str, str],
        dead_letter_topic: str,
        on_answered: Callable[[Request], None],
        queue_size: int,
        metrics: Metrics,
        stall_timeout_s: float = 15.0,
        producer_factory: Callable[[dict[str, Any]], Any] = Producer,
    ) -> None:
        self._metrics = metrics
        self._dead_letter_topic = dead_letter_topic
        self._on_answered = on_answered
        self._inbox: queue.Queue[list[Request]] = queue.Queue(maxsize=queue_size)
        self._new_producer = partial(producer_factory, {**producer_config, "error_cb": self._on_client_error})
        self._producer = self._new_producer()
        self._fatal: KafkaError | None = None
        self._stall_timeout_s = stall_timeout_s
        self._last_report = time.monotonic()
        self._undelivered: list[tuple[_Record, Callable]] = []
        """Records a dead producer failed, with their delivery handlers, to produce again."""
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kinference-publisher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, requests: list[Request]) -> None:
        """Queue finished requests (results or errors) for publishing. Blocks while the queue is full."""
        self._inbox.put(requests)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Publish everything queued, wait for the broker's acknowledgements, then stop."""
        self._stopping.set()
        self._thread.join(timeout_s)
        remaining = self._producer.flush(timeout_s)
        if remaining:
            log.error("%d replies were still unacknowledged at shutdown; their offsets stay uncommitted",
                      remaining)
        # The producer holds our callbacks (a reference cycle): drop it now so librdkafka's threads
        # and connections end with the service, not at some later garbage collection.
        self._producer = None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while True:
            if self._fatal is not None or self._stalled():
                self._replace_producer()
            try:
                requests = self._inbox.get(timeout=_POLL_S)
            except queue.Empty:
                if self._stopping.is_set() and self._fatal is None:
                    return
                self._producer.poll(0)
                continue
            now = time.monotonic()
            for request in requests:
                self._publish(request, now)
            self._producer.poll(0)

    def _stalled(self) -> bool:
        if len(self._producer) == 0:
            self._last_report = time.monotonic()
            return False
        if time.monotonic() - self._last_report < self._stall_timeout_s:
            return False
        self._fatal = KafkaError(KafkaError._TIMED_OUT, f"no delivery report for {self._stall_timeout_s:g} s "
                                 f"with {len(self._producer)} records outstanding")
        return True

    def _replace_producer(self) -> None:
        log.warning("replacing the producer: %s", self._fatal)
        old = self._producer
        # Fail whatever the dead producer still holds; its delivery reports land in _undelivered.
        old.purge(in_queue=True, in_flight=True, blocking=False)
        old.flush(1.0)
        self._producer = self._new_producer()
        self._fatal = None
        self._last_report = time.monotonic()
        self._metrics.producer_replacements.inc()
        undelivered, self._undelivered = self._undelivered, []
        for record, handler in undelivered:
            self._send(record, handler)
        log.warning("new producer: %d records produced again", len(undelivered))

    def _publish(self, request: Request, now: float) -> None:
        observe(self._metrics, request, now)
        request.pending_deliveries = 2 if request.dead_letter else 1
        self._send(reply_record(request, now), partial(self._reply_delivered, request))
        if request.dead_letter:
            assert request.error is not None
            self._send_dead_letter(request, request.error)

    def _send_dead_letter(self, request: Request, error: RequestError, original: bool = True) -> None:
        self._send(dead_letter_record(self._dead_letter_topic, request, error, original),
                   partial(self._dead_letter_delivered, request, error, original))

    def _send(self, record: _Record, handler: Callable) -> None:
        topic, value, key, headers, partition = record
        kwargs = {} if partition is None else {"partition": partition}
        # The record itself rides along: delivery reports do not carry the headers back.
        on_delivery = partial(self._on_delivery, record, handler)
        while True:
            try:
                self._producer.produce(topic, value, key, headers=headers, on_delivery=on_delivery, **kwargs)
                return
            except BufferError:
                # librdkafka's local queue is full: serve delivery reports until there is room.
                self._producer.poll(_POLL_S)
            except KafkaException as exc:
                error = exc.args[0]
                if not error.fatal():
                    # Refused at once (too large, unknown topic or partition): the same path as a
                    # failed delivery, so the request still gets its answer or dead letter.
                    handler(error, None)
                    return
                self._fatal = error
                self._replace_producer()

    def _on_delivery(self, record: _Record, handler: Callable, err: KafkaError | None, message: Any) -> None:
        self._last_report = time.monotonic()
        if err is not None and (self._fatal is not None or err.fatal()):
            # Not the record's fault: the producer died. Keep it for the replacement producer.
            self._fatal = self._fatal or err
            self._undelivered.append((record, handler))
            return
        handler(err, message)

    def _reply_delivered(self, request: Request, err: KafkaError | None, _msg: Any) -> None:
        if err is None:
            self._metrics.replies.labels("ok" if request.ok else "error").inc()
            self._delivered(request)
            return
        self._metrics.delivery_failures.labels("reply").inc()
        if err.code() == KafkaError.MSG_SIZE_TOO_LARGE and request.ok:
            # The result is too large for the broker: the caller gets a small error reply instead.
            request.fail(RequestError(f"the result is too large to publish: {err.str()}", ErrorCode.HANDLER_ERROR))
            self._send(reply_record(request, time.monotonic()), partial(self._reply_delivered, request))
            return
        log.error("reply to %s failed: %s; sending the request to %s", request.reply_topic, err,
                  self._dead_letter_topic, extra=about(request))
        request.pending_deliveries += 1
        self._send_dead_letter(
            request,
            RequestError(f"reply to {request.reply_topic} could not be delivered: {err}",
                         ErrorCode.INTERNAL_ERROR),
        )
        self._delivered(request)

    def _dead_letter_delivered(self, request: Request, error: RequestError, original: bool,
                               err: KafkaError | None, _msg: Any) -> None:
        if err is None:
            self._metrics.dead_letters.inc()
            self._delivered(request)
            return
        self._metrics.delivery_failures.labels("dead_letter").inc()
        if err.code() == KafkaError.MSG_SIZE_TOO_LARGE and original:
            # Keep the record of the failure, without the original value and headers that made it too large.
            self._send_dead_letter(request, error, original=False)
            return
        log.critical("dead letter failed: %s; the offset stays uncommitted", err, extra=about(request))

    def _delivered(self, request: Request) -> None:
        request.pending_deliveries -= 1
        if request.pending_deliveries == 0:
            self._on_answered(request)

    def _on_client_error(self, err: KafkaError) -> None:
        if err.fatal():
            self._fatal = err
            log.error("producer fatal error (the producer will be replaced): %s", err)
        else:
            log.warning("producer: %s", err)
