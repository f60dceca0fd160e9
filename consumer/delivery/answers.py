"""What answers a request (its reply and dead-letter records: their values and headers), and what happens when the
broker refuses one of them.

Both delivery modes answer the same way (``at_least_once`` produces the records at once, ``exactly_once`` inside
a transaction; the publisher produces them); only when an answer counts as done differs. A request is answered by

- its reply: the result, or an error reply with its code, to its reply topic and partition;
- plus a dead letter when the record could not be read as a request (original key, value and headers, and
  why), or only the dead letter when not even its headers could be read (nobody knows where to reply).

When the broker refuses a record, ``classify`` decides:

- ``TRANSIENT``: not the record's fault (timed out during an outage, purged, not enough replicas...): the
  same record is produced again, with backoff, up to the delivery retry timeout;
- ``PERMANENT``: the record can never be delivered: ``replacement`` says what answers the request instead
  (a result too large for the broker becomes a small ``handler_error`` reply; a reply whose topic refuses it
  becomes a dead letter; a dead letter too large loses the original value and headers, and says so). When
  nothing can answer the request (the dead-letter topic itself refuses), the request is unanswerable: counted,
  logged and committed past (``publisher``), never a reason to stop. A key too large to ride on any record never
  gets this far: the decoder leaves it out (``request.RequestDecoder.max_key_bytes``), and the answers say so;
- ``FATAL``: the producer itself is finished; the record waits for the next producer.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from confluent_kafka import KafkaError

from kinference.consumer.ledger.request import Request
from kinference.consumer.types import Headers
from kinference.errors import RequestError
from kinference.protocol import (
    BATCH_SIZE,
    CORRELATION_ID,
    ERROR_CODE,
    ERROR_MESSAGE,
    INFERENCE_MS,
    KEY_OMITTED,
    MAX_ERROR_MESSAGE,
    ORIGINAL_OMITTED,
    QUEUE_MS,
    SERVICE_MS,
    SOURCE_OFFSET,
    SOURCE_PARTITION,
    SOURCE_TOPIC,
    SPRING_CORRELATION_ID,
    STATUS,
    ErrorCode,
    encode_error,
)

Record = tuple[str, bytes | None, bytes | None, Headers, int | None]
"""topic, value, key, headers, partition: what is needed to produce a record (again)."""


class Refusal(enum.Enum):
    TRANSIENT = "transient"
    PERMANENT = "permanent"
    FATAL = "fatal"


_TOO_LARGE = frozenset({KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE})
_NEVER_DELIVERABLE = _TOO_LARGE | {
    KafkaError.UNKNOWN_TOPIC_OR_PART,
    KafkaError._UNKNOWN_TOPIC,
    KafkaError._UNKNOWN_PARTITION,
    KafkaError.TOPIC_AUTHORIZATION_FAILED,
    KafkaError.TOPIC_EXCEPTION,
    KafkaError.INVALID_RECORD,
    KafkaError.POLICY_VIOLATION,
    KafkaError._INVALID_ARG,
}
"""Codes that say this record can never be delivered as it is. Anything else that is not fatal passes (librdkafka
sets no ``retriable()`` flag on delivery reports, so the codes decide)."""


def classify(error: KafkaError) -> Refusal:
    if error.fatal():
        return Refusal.FATAL
    return Refusal.PERMANENT if error.code() in _NEVER_DELIVERABLE else Refusal.TRANSIENT


@dataclass(slots=True, eq=False)
class Delivery:
    """One record produced to answer one request."""

    request: Request
    kind: Literal["reply", "dead_letter"]
    record: Record
    first_attempt: float
    """``time.monotonic()`` of the first produce of this record: transient failures are retried up to a bound."""
    reason: RequestError | None = None
    """A dead letter's: why the request could not be served."""
    error: RequestError | None = None
    """The error this record answers its request with when it is not the request's own (``Request.error``, which
    comes first): its reply partition missing (``ReplyPartitions``), no result, its result too large
    (``replacement``), or nothing could answer it (unanswerable, the publisher's). The delivery's outcome, never
    written on the request: what counts, logs and settles the answer reads ``outcome``."""
    original: bool = True
    """A dead letter with the original value and headers (False once they made it too large)."""
    attempts: int = 0
    counts_as: str = "ok"
    """What it counts as once delivered (``kinference_replies_total``'s ``ok`` or ``error``, or ``dead_letter``):
    known when it is written, so that counting a turn's records reads one field of each."""
    epoch: int = 0
    """``InFlight.epoch`` when it was last produced: a report from an earlier one (a replaced producer, an aborted
    transaction) is stale."""

    @property
    def outcome(self) -> RequestError | None:
        """What its request is answered with: the request's own error first, else the delivery's; None: ok."""
        return self.request.error or self.error


class InFlight:
    """The publisher's records produced and not yet reported on, in the order produced, and the epoch that tells a
    stale report (a record's ``epoch`` is not this one): ``void`` moves it on, for a replaced producer or an aborted
    transaction, whose records' reports no longer count."""

    __slots__ = ("epoch", "records")

    def __init__(self) -> None:
        self.epoch = 0
        self.records: dict[Delivery, None] = {}

    def add(self, delivery: Delivery) -> None:
        delivery.epoch = self.epoch
        self.records[delivery] = None

    def void(self) -> list[Delivery]:
        """From now on, reports about the records produced so far are stale; those not reported on yet, returned."""
        self.epoch += 1
        records, self.records = list(self.records), {}
        return records


@dataclass(frozen=True, slots=True)
class Settled:
    """What one turn of a delivery mode answered for good (``AtLeastOnce.end``, ``ExactlyOnce.end``)."""

    answered: list[Request]
    """Requests answered now: the publisher ends their spans."""
    landed: list[Delivery]
    """Records that count as delivered now: the publisher counts them (replies, error replies, dead letters)."""
    failure: str | None = None
    """Why the service must stop (transactions aborted too often in a row), if it must."""
    errors: dict[Request, RequestError] = field(default_factory=dict)
    """Those of ``answered`` that the delivery answered with an error of its own (``Delivery.error``: their own
    ``error`` is None), with it: their spans end with it. Rare, so usually empty."""


@dataclass(frozen=True, slots=True)
class StreamChunk:
    """One ``chat.completion.chunk`` record of a generative request (``path.generations``). It does not answer its
    request (the final does): a delivery mode that streams (``streams``) produces it as it comes, before that
    final, best effort and never tracked for the commit."""

    request: Request
    value: bytes
    headers: Headers

    @property
    def record(self) -> Record:
        """To its request's reply topic and partition, with its key: where the final goes too."""
        request = self.request
        return request.reply_topic, self.value, request.key, self.headers, request.reply_partition


def answer(request: Request, dead_letter_topic: str, now: float, misdirected: RequestError | None = None
           ) -> list[Delivery]:
    """The records that answer ``request`` now (``answer_all`` of one)."""
    return answer_all([request], dead_letter_topic, now, {request: misdirected} if misdirected else None)


def answer_all(requests: Iterable[Request], dead_letter_topic: str, now: float,
               misdirected: dict[Request, RequestError] | None = None) -> list[Delivery]:
    """The records that answer ``requests`` now, written in one pass: what a micro-batch's replies share (their
    batch headers) is made once (``BatchHeaders``). ``misdirected``: the requests whose reply partition does not
    exist (``ReplyPartitions.check``), each with its error: its reply goes to the default partition, with that error
    unless the request has its own."""
    deliveries = []
    shared = BatchHeaders()
    for request in requests:
        wrong = misdirected.get(request) if misdirected else None
        if not request.unroutable:
            partition = request.reply_partition if wrong is None else None
            deliveries.append(_reply(request, now, wrong, partition, shared))
        if request.dead_letter:
            error = request.error or RequestError("the record is not a valid request", ErrorCode.BAD_REQUEST)
            deliveries.append(_dead_letter(request, dead_letter_topic, error, now, error=wrong))
    return deliveries


class BatchHeaders:
    """The reply headers that every request of one micro-batch shares (its size and inference time), made once per
    micro-batch rather than once per reply."""

    __slots__ = ("_made",)

    def __init__(self) -> None:
        self._made: dict[tuple[int, float], Headers] = {}

    def of(self, batch_size: int, inference_ms: float) -> Headers:
        made = self._made.get((batch_size, inference_ms))
        if made is None:
            made = self._made[batch_size, inference_ms] = [(BATCH_SIZE, str(batch_size).encode()),
                                                           (INFERENCE_MS, b"%.3f" % inference_ms)]
        return made


class ReplyPartitions:
    """Checks the reply partition a client asked for (``kafka_replyPartition``) against the reply topic's metadata,
    before anything is produced: a partition the topic lacks would be refused by the broker, and in a transaction
    that refusal aborts the transaction with every other request's reply in it. Such a request is answered with
    ``bad_request`` on the default reply partition instead.

    Partition counts are cached for ``ttl_s`` (a topic that grows is seen within that time); a topic whose metadata
    cannot be had is not judged here (the broker's refusal then answers as for any refused record)."""

    def __init__(self, partitions: Callable[[str], int | None], ttl_s: float = 10.0) -> None:
        """``partitions(topic)``: the topic's partition count from the broker's metadata, None if unknown."""
        self._partitions = partitions
        self._ttl_s = ttl_s
        self._known: dict[str, tuple[int | None, float]] = {}

    def check(self, requests: Iterable[Request]) -> dict[Request, RequestError]:
        """The requests whose reply partition the reply topic lacks, each with the error that answers it (``answer``'s
        ``misdirected``); the requests themselves are left as they are."""
        misdirected = {}
        for request in requests:
            asked = request.reply_partition
            if asked is None:
                continue
            count = self.count(request.reply_topic)
            if count is not None and asked >= count:
                misdirected[request] = RequestError(f"reply partition {asked} does not exist: {request.reply_topic} "
                                                    f"has {count} partitions; the reply goes to its default partition",
                                                    ErrorCode.BAD_REQUEST)
        return misdirected

    def count(self, topic: str) -> int | None:
        """The topic's partition count (cached); None when the broker does not say."""
        now = time.monotonic()
        known = self._known.get(topic)
        if known is None or now - known[1] > self._ttl_s:
            known = self._known[topic] = (self._partitions(topic), now)
        return known[0]


def replacement(refused: Delivery, error: KafkaError, dead_letter_topic: str, now: float) -> list[Delivery]:
    """What answers the request instead of a record the broker refused for good; empty when nothing can."""
    request = refused.request
    too_large = error.code() in _TOO_LARGE
    if refused.kind == "reply":
        if too_large and refused.outcome is None:
            too_large_error = RequestError(f"the result is too large to publish: {error.str()}",
                                           ErrorCode.HANDLER_ERROR)
            return [_reply(request, now, too_large_error, refused.record[4])]
        reason = RequestError(f"reply to {refused.record[0]} could not be delivered: {error.str()}",
                              ErrorCode.INTERNAL_ERROR)
        return [_dead_letter(request, dead_letter_topic, reason, now, error=refused.error)]
    if too_large and refused.original and refused.reason is not None:
        # Keep the record of the failure, without the original value and headers that made it too large.
        return [_dead_letter(request, dead_letter_topic, refused.reason, now, original=False, error=refused.error)]
    return []


def _reply(request: Request, now: float, error: RequestError | None, partition: int | None,
           shared: BatchHeaders | None = None) -> Delivery:
    """``error``: the delivery's, answering in place of a request without one of its own."""
    if request.error is None and error is None and request.reply_value is None:
        # postprocess sets reply_value on every ok request; if that ever fails, the caller still gets an answer.
        error = RequestError("the request finished without a result", ErrorCode.INTERNAL_ERROR)
    outcome = request.error or error
    value = reply_value(request, outcome)  # first: the value's format may put its schema id in a header
    record = (request.reply_topic, value, request.key, reply_headers(request, now, outcome, shared), partition)
    return Delivery(request, "reply", record, now, error=None if request.error is not None else error,
                    counts_as="ok" if outcome is None else "error")


def _dead_letter(request: Request, topic: str, reason: RequestError, now: float, original: bool = True,
                 error: RequestError | None = None) -> Delivery:
    """With ``original`` the request's value and headers ride along; without, only kinference's headers. ``error``:
    the delivery's outcome for the request (``Delivery.error``), carried on from the record it replaces."""
    record = (topic, request.value if original else None, request.key, dead_letter_headers(request, reason, original),
              None)
    return Delivery(request, "dead_letter", record, now, reason=reason, original=original, error=error,
                    counts_as="dead_letter")


_OK = (STATUS, b"ok")
_ERROR = (STATUS, b"error")


def reply_headers(request: Request, now: float, outcome: RequestError | None = None,
                  shared: BatchHeaders | None = None) -> Headers:
    """Headers of the reply: status, correlation and the server-side timings clients report on. ``outcome``: the
    error the reply answers with (by default the request's own); ``shared``: its micro-batch's common headers."""
    outcome = outcome or request.error
    headers: Headers = [
        (CORRELATION_ID, request.correlation_id.encode()),
        _OK if outcome is None else _ERROR,
        (SERVICE_MS, _ms(now - request.received)),
    ]
    if request.spring_correlation_id is not None:
        headers.append((SPRING_CORRELATION_ID, request.spring_correlation_id))
    if outcome is not None:
        headers.append((ERROR_CODE, str(outcome.code).encode()))
    if request.dispatched is not None:
        headers.append((QUEUE_MS, _ms(request.dispatched - request.received)))
        headers += (shared or BatchHeaders()).of(request.batch_size, request.inference_ms)
    if request.model is not None:
        headers += request.model.reply_headers
    if request.reply_format is not None:
        headers += request.reply_format.value_headers
    if request.trace is not None:
        headers += request.trace.context_headers()  # the caller's trace goes on from the request's span
    if request.key_omitted is not None:
        headers += _omitted(request)
    return headers


def reply_value(request: Request, outcome: RequestError | None = None) -> bytes:
    """The reply's value: the result, or the error reply of ``outcome`` (by default the request's own error)."""
    error = outcome or request.error
    if error is None:
        if request.reply_value is not None:
            return request.reply_value
        error = RequestError("the request finished without a result", ErrorCode.INTERNAL_ERROR)
    if request.reply_format is not None:
        return request.reply_format.error(error.code, error.message[:MAX_ERROR_MESSAGE])
    return encode_error(error.code, error.message)


def dead_letter_headers(request: Request, error: RequestError, original: bool = True) -> Headers:
    """The original headers (with ``original``) plus where the record came from and why it could not be
    served, and what was left out."""
    return [
        *(request.headers if original else [(ORIGINAL_OMITTED, b"true")]),
        (ERROR_CODE, str(error.code).encode()),
        (ERROR_MESSAGE, error.message[:MAX_ERROR_MESSAGE].encode()),
        (SOURCE_TOPIC, request.topic.encode()),
        (SOURCE_PARTITION, str(request.partition).encode()),
        (SOURCE_OFFSET, str(request.offset).encode()),
        *_omitted(request),
    ]


def _omitted(request: Request) -> Headers:
    return [] if request.key_omitted is None else [(KEY_OMITTED, str(request.key_omitted).encode())]


def _ms(seconds: float) -> bytes:
    return b"%.3f" % (seconds * 1000)
