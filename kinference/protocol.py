"""The wire format that the service and its clients share: header names, error codes, the reply value.

It needs only orjson, so a client installs without the service. docs/protocol.md describes it for users.
"""

from __future__ import annotations

import array
import base64
import json
import re
import struct
import sys
from enum import StrEnum
from typing import Any, Literal

import orjson

CORRELATION_ID = "kinference-correlation-id"
REPLY_TO = "kinference-reply-to"
DEADLINE_MS = "kinference-deadline-ms"
STATUS = "kinference-status"
ERROR_CODE = "kinference-error-code"
ERROR_MESSAGE = "kinference-error-message"
QUEUE_MS = "kinference-queue-ms"
BATCH_SIZE = "kinference-batch-size"
INFERENCE_MS = "kinference-inference-ms"
SERVICE_MS = "kinference-service-ms"
SOURCE_TOPIC = "kinference-source-topic"
SOURCE_PARTITION = "kinference-source-partition"
SOURCE_OFFSET = "kinference-source-offset"
KEY_OMITTED = "kinference-key-omitted"
"""On a reply or dead letter: the request's key was left out, too large to ride on it; the value is its size in
bytes (``max_key_bytes``)."""
ORIGINAL_OMITTED = "kinference-original-omitted"
"""On a dead letter: the request's own value and headers were left out, too large for the topic with them."""
MODEL = "kinference-model"
"""On a request: the model to serve it (several models in one process); on a reply: the model that did."""
MODEL_VERSION = "kinference-model-version"
"""On a request: the model version it needs; on a reply: the version that served it (when the model has one)."""
EVENT = "kinference-event"
"""On the records that answer a generative request: ``delta`` (a stream chunk) or ``final`` (the whole answer, or its
error); see docs/generative.md."""
SEQUENCE = "kinference-sequence"
"""On those records: 0, 1, 2... within one attempt, the final included, so a client sees a gap or a duplicate."""
ATTEMPT = "kinference-attempt"
"""On those records: which generation of the request they belong to. A request generated again (its partition moved
to another member) gets a new attempt id; a client drops the chunks of the abandoned one."""
# Spring Kafka's ReplyingKafkaTemplate headers (KafkaHeaders.CORRELATION_ID, REPLY_TOPIC, REPLY_PARTITION).
SPRING_CORRELATION_ID = "kafka_correlationId"
SPRING_REPLY_TOPIC = "kafka_replyTopic"
SPRING_REPLY_PARTITION = "kafka_replyPartition"

PayloadFormat = Literal["json", "bytes", "record"]
"""How a handler wants request values: ``json`` parsed with orjson, ``bytes`` handed over raw, ``record`` the raw
value with the record's key, headers and correlation id (``kinference.handlers.base.Record``)."""

BOOTSTRAP_SERVERS_ENV = "KINFERENCE_BOOTSTRAP_SERVERS"
KAFKA_PROPERTIES_ENV = "KINFERENCE_KAFKA"
"""The env vars that ``kinference serve``, ``topics``, ``loadgen`` and ``Client.from_env`` all read: where the
brokers are, and the librdkafka properties every client needs (security, SASL, TLS)."""

_NEXT_PAIR = re.compile(r"[,\n]\s*(?=[A-Za-z0-9_.-]+=)")
"""Where a string of ``key=value`` items splits: at a comma or newline followed by the next ``key=``, so a
value may hold commas (``partition.assignment.strategy=range,roundrobin``)."""


def parse_properties(text: str) -> dict[str, str]:
    """librdkafka properties as ``KINFERENCE_KAFKA`` holds them: a JSON object (numbers and booleans become the
    strings librdkafka takes), or ``key=value`` items separated by commas or newlines. Raises ``ValueError``
    without echoing the text (it may hold a secret)."""
    stripped = text.strip()
    if stripped.startswith("{"):
        try:
            loaded = json.loads(stripped)
        except ValueError:
            raise ValueError(f"expected a JSON object of properties ({len(stripped)} characters that do not parse)") \
                from None
        if not isinstance(loaded, dict):
            raise ValueError("expected a JSON object of properties")
        return {str(key): ("true" if value else "false") if isinstance(value, bool) else str(value)
                for key, value in loaded.items()}
    pairs = {}
    for item in _NEXT_PAIR.split(stripped):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"expected key=value, got an item of {len(item)} characters without '='")
        pairs[key.strip()] = value.strip()
    return pairs


MAX_ERROR_MESSAGE = 1000
"""Error messages are cut to this many characters in replies and dead-letter headers."""
MAX_JSON_DEPTH = 64
"""The deepest nesting of arrays and objects a JSON request value may have; a deeper one gets ``bad_request``."""


class ErrorCode(StrEnum):
    """Codes of the ``{"error": {"code": ...}}`` reply. Clients may switch on them: never rename."""

    BAD_REQUEST = "bad_request"
    """The record is not a valid request: undecodable value or headers, or rejected by the handler."""
    INPUT_TOO_LONG = "input_too_long"
    """A text has more tokens than the model takes (its ``max_seq_length``, or ``max_length``), and neither the request
    nor the service asked to cut it (``"truncate": true``); the message gives its token count and the limit."""
    PAYLOAD_TOO_LARGE = "payload_too_large"
    """The record value is larger than ``max_request_bytes``, or its headers than ``max_header_bytes``."""
    DEADLINE_EXCEEDED = "deadline_exceeded"
    """The ``kinference-deadline-ms`` deadline passed before the request was computed."""
    OVERLOADED = "overloaded"
    """Shed unanswered: the request was older than ``max_queue_ms`` when the service got to it, or (several models)
    its model held its share of ``max_in_flight``."""
    HANDLER_ERROR = "handler_error"
    """The handler raised, or returned outputs that do not match its inputs."""
    HANDLER_TIMEOUT = "handler_timeout"
    """A handler call (preprocess, inference or postprocess) of the request's micro-batch ran longer than
    ``handler_timeout_s``; the model is then unhealthy, and the record is dead-lettered."""
    DEVICE_HUNG = "device_hung"
    """The device process's batch that held the request made no progress for ``device_hang_s``; that device
    process is replaced."""
    REPLY_TOPIC_NOT_ALLOWED = "reply_topic_not_allowed"
    """The request named a reply topic outside the service's allow-list; the error reply goes to the default
    reply topic instead."""
    REPLY_TOPIC_NOT_FOUND = "reply_topic_not_found"
    """The request named an allowed reply topic that does not exist (kinference never creates one); the error reply
    goes to the default reply topic instead, at once."""
    MODEL_NOT_FOUND = "model_not_found"
    """The request names a model (``kinference-model``/``kinference-model-version``, or MLServer's
    ``mlserver-model``/``mlserver-version`` headers) this service does not serve."""
    INTERNAL_ERROR = "internal_error"
    """A fault in kinference itself; the message says what failed."""


def encode_result(result: Any) -> bytes:
    """The reply value of a successful request: ``{"result": ...}`` (numpy arrays become lists)."""
    return orjson.dumps({"result": result}, option=orjson.OPT_SERIALIZE_NUMPY)


def encode_error(code: ErrorCode | str, message: str) -> bytes:
    """The reply value of a failed request: ``{"error": {"code": ..., "message": ...}}``."""
    return orjson.dumps({"error": {"code": str(code), "message": message[:MAX_ERROR_MESSAGE]}})


def decode_error(value: bytes | None) -> dict[str, Any]:
    """The ``error`` object of a reply value; empty when the value holds none."""
    try:
        body = orjson.loads(value) if value else None
    except orjson.JSONDecodeError:
        return {}
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else {}


def encode_partition(partition: int) -> bytes:
    """``kafka_replyPartition``: a 4-byte big-endian int, as Spring writes it."""
    return struct.pack(">i", partition)


def decode_partition(raw: bytes) -> int:
    """Inverse of ``encode_partition``; ``ValueError`` says what is wrong."""
    if len(raw) != 4:
        raise ValueError(f"header {SPRING_REPLY_PARTITION} must be a 4-byte big-endian int")
    partition: int = struct.unpack(">i", raw)[0]
    if partition < 0:
        raise ValueError(f"header {SPRING_REPLY_PARTITION} is negative")
    return partition


def encode_deadline(epoch_ms: int) -> bytes:
    """``kinference-deadline-ms``: epoch milliseconds as ASCII digits."""
    return str(epoch_ms).encode("ascii")


def decode_deadline(raw: bytes) -> int:
    """Inverse of ``encode_deadline``; ``ValueError`` says what is wrong."""
    try:
        return int(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"header {DEADLINE_MS} must be epoch milliseconds") from exc


def decode_embedding(embedding: str | list[float]) -> list[float]:
    """An embedding as a list of floats, from either of the embedding handler's ``encoding_format`` values:
    a JSON array (``float``) or base64 of little-endian float32 (``base64``)."""
    if isinstance(embedding, list):
        return embedding
    floats = array.array("f", base64.b64decode(embedding, validate=True))
    if sys.byteorder == "big":
        floats.byteswap()
    return floats.tolist()
