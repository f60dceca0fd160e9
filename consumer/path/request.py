"""How a Kafka record becomes a ``Request`` (``RequestDecoder``): the inbound side only. The ``Request`` itself, the
value that travels through the service, is the floor's (``ledger.request``); what its reply and dead-letter records
carry is in ``delivery.answers``; the header names and value formats themselves are in ``kinference.protocol``.
"""

from __future__ import annotations

import gc
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from confluent_kafka import TIMESTAMP_NOT_AVAILABLE

from kinference.consumer.ledger.request import Request
from kinference.consumer.types import Headers
from kinference.consumer.wire import jsonscan, oip
from kinference.errors import RequestError
from kinference.handlers.base import Record
from kinference.protocol import (
    CORRELATION_ID,
    DEADLINE_MS,
    MAX_JSON_DEPTH,
    MODEL,
    MODEL_VERSION,
    REPLY_TO,
    SPRING_CORRELATION_ID,
    SPRING_REPLY_PARTITION,
    SPRING_REPLY_TOPIC,
    ErrorCode,
    PayloadFormat,
    decode_deadline,
    decode_partition,
)

if TYPE_CHECKING:  # the Schema Registry client and OpenTelemetry are optional extras: imported only when configured
    from kinference.consumer.ops.tracing import Tracing
    from kinference.consumer.path.router import ModelRoute, Router
    from kinference.consumer.wire.serdes import SchemaRegistryFormat

_LEGAL_TOPIC = re.compile(r"[A-Za-z0-9._-]{1,249}")
_ROUTING = frozenset({CORRELATION_ID, SPRING_CORRELATION_ID, REPLY_TO, SPRING_REPLY_TOPIC, SPRING_REPLY_PARTITION,
                      DEADLINE_MS})
"""The headers that route a request's answer (``_read_routing``)."""
_NAMING = frozenset({MODEL, MODEL_VERSION, oip.MODEL_HEADER, oip.VERSION_HEADER})
"""The headers that name a request's model (``oip.named_model``)."""


def _any_topic(_topic: str) -> bool:
    return True


@dataclass(frozen=True, slots=True)
class RequestDecoder:
    """Turns consumed records into ``Request`` values; never raises for a bad record."""

    default_reply_topic: str
    max_request_bytes: int
    payload_format: PayloadFormat = "json"
    max_header_bytes: int = 16_384
    reply_topic_allowed: Callable[[str], bool] = _any_topic
    """Whether a request may name this reply topic (``config.ServiceConfig.reply_topic_allowed``)."""
    reply_topic_exists: Callable[[str], bool] = _any_topic
    """Whether an allowed reply topic exists (``topic_metadata.ExistingTopics``): a reply is never produced to a
    topic that does not, which would wait out its delivery timeout, or create the topic."""
    model: oip.ServedModel | None = None
    """The served model, for Open Inference Protocol requests; None: kinference's own JSON only."""
    schemas: SchemaRegistryFormat | None = None
    """The Schema Registry format of request and reply values (``--value-format``); None: JSON."""
    router: Router | None = None
    """Which model serves each record; its model's payload format and OIP model then replace ``payload_format``
    and ``model``. None: one unnamed model."""
    max_key_bytes: int = 4096
    """A larger key fails its request, and is left out of it: every answer carries the request's key, and one too
    large for the topic could never be delivered."""
    tracing: Tracing | None = None
    """Starts each decoded request's span (``--tracing``); None: tracing is off."""

    def decode(self, record: Any, received: float | None = None, ledger: Any = None) -> Request:
        """``record`` is a confluent_kafka.Message (or anything with the same accessors), ``ledger`` where its
        tracker follows it (``Request.ledger``). Its coordinates are read first and cannot fail; whatever fails
        after that becomes the request's error."""
        topic, partition, offset = record.topic(), record.partition(), record.offset()
        request = Request(
            topic=topic,
            partition=partition,
            offset=offset,
            key=None,
            value=None,
            headers=[],
            received=time.monotonic() if received is None else received,
            correlation_id=f"{topic}/{partition}/{offset}",
            reply_topic=self.default_reply_topic,
            ledger=ledger,
        )
        try:
            request.key, request.value = self._bounded_key(request, record.key()), record.value()
            request.timestamp_ms = _timestamp(record)
            request.headers = _headers(record, request)
            named = self._read_headers(request)
            if request.key_omitted is not None:
                raise RequestError(f"request key is {request.key_omitted} bytes; max_key_bytes is "
                                   f"{self.max_key_bytes} (the answers go without it)", ErrorCode.PAYLOAD_TOO_LARGE)
            payload_format, model = self.payload_format, self.model
            if self.router is not None:
                request.model = route = self._route(request, self.router, named)
                payload_format, model = route.payload_format, route.served
            # Only a record with a model header can ask for OIP where the model takes either: most have none.
            if model is not None and (named or model.request_format == "oip") and model.speaks_oip(request.headers):
                self._check_size(request.value)
                # Set first, so that even a request that fails to decode is answered in OIP's shape.
                request.reply_format = oip.OipCall(oip.request_id(request.key, {}, request.correlation_id),
                                                   model, None)
                request.payload, request.reply_format = oip.decode(request.value, request.key, dict(request.headers),
                                                                   model, payload_format, request.correlation_id)
            elif self.schemas is not None:
                self._check_size(request.value)
                request.payload = self.schemas.decode(topic, request.value, request.headers)
            else:
                request.payload = self._read_value(request, payload_format)
        except RequestError as exc:
            request.error = exc
            request.dead_letter = True
        except Exception as exc:  # a record this decoder did not foresee: still a dead letter, never a crash
            request.error = RequestError(f"the record could not be decoded: {exc!r}", ErrorCode.INTERNAL_ERROR)
            request.dead_letter = True
        if self.schemas is not None:
            # Whatever failed: every reply on the topic is in its format, written for the topic read from the headers.
            request.reply_format = self.schemas.reply(request.reply_topic)
        request.held_bytes = self._held_bytes(request)
        if self.tracing is not None:
            request.trace = self.tracing.received(request)
        return request

    @staticmethod
    def undecoded(record: Any, ledger: Any) -> Request:
        """A tracked record handed back before it was decoded (its partition revoked): a request that holds nothing
        but its coordinates and ``ledger``, for the ledger to let go of."""
        topic, partition, offset = record.topic(), record.partition(), record.offset()
        return Request(topic=topic, partition=partition, offset=offset, key=None, value=None, headers=[],
                       received=time.monotonic(), correlation_id=f"{topic}/{partition}/{offset}", reply_topic="",
                       ledger=ledger)

    def _held_bytes(self, request: Request) -> int:
        """About what the request's value holds once decoded, raw bytes included: computed from the bytes at C speed
        (``jsonscan.decoded_bytes`` for JSON), never by walking the decoded value."""
        value = request.value or b""
        if request.payload is None or isinstance(request.payload, bytes | Record):
            return len(value)  # not decoded, or handed over as the bytes themselves
        if self.schemas is not None:
            return self.schemas.held_bytes(value)  # bounded by the record's schema
        return jsonscan.decoded_bytes(value)

    def _route(self, request: Request, router: Router, named: bool) -> ModelRoute:
        """``named``: the record has a header naming a model; without one, its topic alone routes it."""
        if not named:
            return router.for_topic(request.topic)
        try:
            return router.route(request.topic, request.headers)
        except RequestError:
            served = router.default.served
            if served is not None and served.speaks_oip(request.headers):
                # An OIP caller naming a model not served here gets OIP's error body, as MLServer answers it.
                request.reply_format = oip.OipCall(oip.request_id(request.key, {}, request.correlation_id), served,
                                                   None)
            raise

    def _read_headers(self, request: Request) -> bool:
        """The routing headers, then the headers' size (summed in the same pass over them); whether a header names a
        model (read in the same pass too)."""
        problems, size, named = _read_routing(request)
        if request.spring_correlation_id is not None and not _has_header(request.headers, CORRELATION_ID):
            request.correlation_id = request.spring_correlation_id.hex()
        if request.reply_topic != self.default_reply_topic and not self.reply_topic_allowed(request.reply_topic):
            # Whatever else is wrong, nothing is ever written to a topic outside the allow-list: the answer goes
            # to the default reply topic. Not a dead letter by itself: the record only asks for a route this
            # service does not serve.
            asked, request.reply_topic, request.reply_partition = request.reply_topic, self.default_reply_topic, None
            refusal = (f"reply topic {asked!r} is not allowed (--reply-topics-allowed); the reply goes to "
                       f"{self.default_reply_topic!r}")
            if problems:
                problems.append(refusal)
            else:
                request.fail(RequestError(refusal, ErrorCode.REPLY_TOPIC_NOT_ALLOWED))
        elif request.reply_topic != self.default_reply_topic and not self.reply_topic_exists(request.reply_topic):
            asked, request.reply_topic, request.reply_partition = request.reply_topic, self.default_reply_topic, None
            missing = f"reply topic {asked!r} does not exist; the reply goes to {self.default_reply_topic!r}"
            if problems:
                problems.append(missing)
            else:
                request.fail(RequestError(missing, ErrorCode.REPLY_TOPIC_NOT_FOUND))
        if problems:
            # Routing headers were read as far as possible first, so the error reply still finds its caller.
            raise RequestError("; ".join(problems), ErrorCode.BAD_REQUEST)
        if size > self.max_header_bytes:
            raise RequestError(f"request headers are {size} bytes; max_header_bytes is {self.max_header_bytes}",
                               ErrorCode.PAYLOAD_TOO_LARGE)
        return named

    def _bounded_key(self, request: Request, key: bytes | None) -> bytes | None:
        """The key, or None when it is too large (its size kept in ``key_omitted``). Left out first of all, so
        that nothing, not even the error reply of a request whose headers cannot be read, carries it."""
        if key is not None and len(key) > self.max_key_bytes:
            request.key_omitted = len(key)
            return None
        return key

    def _check_size(self, value: bytes | None) -> None:
        size = len(value) if value is not None else 0
        if size > self.max_request_bytes:
            raise RequestError(
                f"request value is {size} bytes; max_request_bytes is {self.max_request_bytes}",
                ErrorCode.PAYLOAD_TOO_LARGE,
            )

    def _read_value(self, request: Request, payload_format: PayloadFormat) -> Any:
        value = request.value
        self._check_size(value)
        if payload_format == "bytes":
            return value or b""
        if payload_format == "record":
            headers = {name: raw.decode("utf-8", "replace") for name, raw in request.headers if raw is not None}
            return Record(value or b"", request.key, headers, request.correlation_id)
        if not value:
            raise RequestError("request value is empty; expected a JSON document", ErrorCode.BAD_REQUEST)
        try:
            document = jsonscan.loads(value)
        except orjson.JSONDecodeError as exc:
            raise RequestError(f"request value is not valid JSON: {exc}", ErrorCode.BAD_REQUEST) from exc
        if not jsonscan.nested_within(value, MAX_JSON_DEPTH):
            raise RequestError(f"request value nests arrays and objects deeper than {MAX_JSON_DEPTH} levels",
                               ErrorCode.BAD_REQUEST)
        return document


def _read_routing(request: Request) -> tuple[list[str], int, bool]:
    """Set the request's correlation, reply route and deadline from its headers; what could not be read, in words,
    the headers' size (names and values), and whether one names a model (``router``, ``oip``), all in one pass.
    Every header is read whatever the others hold, so that an error reply still finds its caller."""
    problems = []
    size = 0
    named = False
    for name, raw in request.headers:
        size += len(name)
        if name not in _ROUTING:
            named = named or name in _NAMING  # a name with no value still counts (``oip.ServedModel.speaks_oip``)
            size += len(raw) if raw is not None else 0
            continue
        if raw is None:
            continue
        size += len(raw)
        try:
            if name == CORRELATION_ID:
                request.correlation_id = _text(raw, name)
            elif name == SPRING_CORRELATION_ID:
                request.spring_correlation_id = raw or None
            elif name in (REPLY_TO, SPRING_REPLY_TOPIC):
                request.reply_topic = _topic(raw, name)
            elif name == SPRING_REPLY_PARTITION:
                request.reply_partition = _partition(raw)
            elif name == DEADLINE_MS:
                request.deadline_ms = _deadline(raw)
        except RequestError as exc:
            problems.append(str(exc))
    return problems, size, named


def _timestamp(record: Any) -> float | None:
    timestamp_type, timestamp = record.timestamp()
    return timestamp if timestamp_type != TIMESTAMP_NOT_AVAILABLE and timestamp > 0 else None


def _headers(record: Any, request: Request) -> Headers:
    """The record's headers, or ``RequestError`` when they cannot be read.

    confluent-kafka builds each ``(name, value)`` tuple without checking that the name decoded as UTF-8. For a
    name that is not UTF-8 the tuple keeps a NULL where the name should be, and either ``headers()`` raises
    ``SystemError`` (the decode error still pending) or, when a later header's decode cleared that error, it
    returns the broken list, which crashes the interpreter as soon as the name is touched. So the raw tuple slots
    are looked at before anything touches a name, and the accessor is never called twice on a record.
    """
    try:
        headers = record.headers() or []
        # The decode error may also surface only at the next call that checks for one: keep that inside too.
        failure: Exception | None = None if _intact(headers) else ValueError("a header name is not UTF-8")
    except Exception as exc:
        failure = exc
    if failure is None:
        return headers
    request.unroutable = True
    cause = failure.__cause__ or failure.__context__ or failure
    raise RequestError(f"the record's headers cannot be read (a header name that is not UTF-8?): {cause!r}",
                       ErrorCode.BAD_REQUEST) from failure


def _intact(headers: list[Any]) -> bool:
    """Every header is a 2-tuple whose slots both hold an object. Reading a NULL slot from Python crashes, but
    iterating the list and taking each tuple's length are safe, and so is ``gc.get_referents``: a tuple's traversal
    skips a NULL slot, so the headers' referents number two per header only when none is NULL. One C call for all
    the headers of a record (reading each slot's raw pointer through ctypes cost about a microsecond a header)."""
    for header in headers:
        if type(header) is not tuple or len(header) != 2:
            return False
    return len(gc.get_referents(*headers)) == 2 * len(headers)


def _has_header(headers: Headers, name: str) -> bool:
    return any(key == name and raw is not None for key, raw in headers)


def _text(raw: bytes, name: str) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(f"header {name} is not UTF-8", ErrorCode.BAD_REQUEST) from exc
    if not text or len(text) > 256:
        raise RequestError(f"header {name} must be 1-256 characters", ErrorCode.BAD_REQUEST)
    return text


def _topic(raw: bytes, name: str) -> str:
    topic = _text(raw, name)
    if not _LEGAL_TOPIC.fullmatch(topic) or topic in (".", ".."):
        raise RequestError(f"header {name} is not a legal topic name: {topic!r}", ErrorCode.BAD_REQUEST)
    return topic


def _partition(raw: bytes) -> int:
    try:
        return decode_partition(raw)
    except ValueError as exc:
        raise RequestError(str(exc), ErrorCode.BAD_REQUEST) from exc


def _deadline(raw: bytes) -> int:
    try:
        return decode_deadline(raw)
    except ValueError as exc:
        raise RequestError(str(exc), ErrorCode.BAD_REQUEST) from exc
