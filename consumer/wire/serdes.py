"""Schema Registry value formats: requests and replies as Avro, Protobuf or JSON Schema records
(``--value-format``), written and read by confluent-kafka's Schema Registry serializers.

A request's schema is its producer's: the deserializer finds it in the registry by the schema id the record
carries (in the value's prefix, the Confluent wire format, or in the ``__value_schema_id`` header), and the
decoded record is the handler's payload, a dict. A value that cannot be decoded (no magic byte, an unknown
schema id, bytes that do not match the schema) is that request's ``bad_request``. The schema id is read first,
bounded, and an id the registry did not know is asked about once per interval (``schemaids``); what the record will
hold decoded is bounded from its schema before it is decoded (``schemabounds``), and a record that could hold more
than the whole byte budget is refused (``payload_too_large``).

A reply is kinference's own ``kinference.Reply`` record (``REPLY_SCHEMAS``), registered under the reply topic's
subject: ``status`` ``ok`` with the result, or ``error`` with the code and message. An embedding
(``{"embedding": float array}``) travels as little-endian float32 bytes in Avro and Protobuf; any other result as
its JSON text. docs/protocol.md maps every field.

Threads: requests are decoded by the poll thread alone; replies are written by the postprocess threads, and
error replies by the publisher thread. The serializers keep per-call state (the schema id of the record being
written), so each thread has its own; they share one registry client, whose cache (thread-safe) makes a schema
one registry call per subject. ``SchemaRegistryFormat.open`` makes that call for the default reply topic at start,
so that an unreachable registry or a missing schema stops the start instead of the first reply.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import orjson
from confluent_kafka.schema_registry import (
    SchemaRegistryClient,
    SchemaRegistryError,
    dual_schema_id_deserializer,
    header_schema_id_serializer,
    prefix_schema_id_serializer,
    record_subject_name_strategy,
    topic_record_subject_name_strategy,
    topic_subject_name_strategy,
)
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.schema_registry.common.protobuf import PROTOBUF_TYPE
from confluent_kafka.schema_registry.common.serde import SchemaId
from confluent_kafka.schema_registry.json_schema import JSONDeserializer, JSONSerializer
from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer, ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from kinference.consumer.config import ServiceConfig
from kinference.consumer.types import Headers
from kinference.consumer.wire import jsonscan, schemabounds, schemaids
from kinference.errors import ConfigError, RequestError
from kinference.protocol import ErrorCode, PayloadFormat, encode_error

if TYPE_CHECKING:  # a type of confluent-kafka's stubs only (a private module, not in its oldest supported release)
    from confluent_kafka._types import HeadersType

try:  # the HTTP client of confluent-kafka's registry client: httpx2 from 2.16, httpx before
    from httpx2 import HTTPError
except ImportError:
    from httpx import HTTPError  # type: ignore[no-redef]  # the same class, from the older package

log = logging.getLogger(__name__)

REPLY_NAME = "kinference.Reply"
"""The reply record's full name in every format (the subject under the record strategies)."""

_STRATEGIES = {
    "topic": topic_subject_name_strategy,
    "record": record_subject_name_strategy,
    "topic-record": topic_record_subject_name_strategy,
}
_FORMAT_NAMES = {"avro": "Avro", "protobuf": "Protobuf", "jsonschema": "JSON Schema"}

AVRO_REPLY = orjson.dumps({
    "type": "record", "name": "Reply", "namespace": "kinference",
    "doc": "A kinference reply: the result of a request, or why it failed.",
    "fields": [
        {"name": "status", "type": "string", "doc": "ok or error, as the kinference-status header."},
        {"name": "result", "type": ["null", "string"], "default": None,
         "doc": "The result as JSON text; null for an embedding and for an error."},
        {"name": "embedding", "type": ["null", "bytes"], "default": None,
         "doc": "An embedding result: little-endian float32."},
        {"name": "error", "type": ["null", {"type": "record", "name": "Error", "fields": [
            {"name": "code", "type": "string"}, {"name": "message", "type": "string"}]}], "default": None},
    ],
}).decode()

JSON_SCHEMA_REPLY = orjson.dumps({
    "$schema": "http://json-schema.org/draft-07/schema#",
    "title": REPLY_NAME,
    "description": "A kinference reply: the result of a request, or why it failed.",
    "type": "object",
    "properties": {
        "status": {"enum": ["ok", "error"]},
        "result": {"description": "The handler's result, as kinference's JSON reply holds it."},
        "error": {"type": "object", "properties": {"code": {"type": "string"}, "message": {"type": "string"}},
                  "required": ["code", "message"]},
    },
    "required": ["status"],
}).decode()


def _protobuf_reply() -> type:
    """``kinference.Reply`` as a Protobuf message class, built from its descriptor (no protoc at run time)::

        syntax = "proto3";
        package kinference;
        message Reply {
          message Error { string code = 1; string message = 2; }
          string status = 1;
          oneof outcome { string result = 2; bytes embedding = 3; Error error = 4; }
        }
    """
    proto = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name="kinference/reply.proto", package="kinference", syntax="proto3")
    reply = file.message_type.add(name="Reply")
    error = reply.nested_type.add(name="Error")
    error.field.add(name="code", number=1, type=proto.TYPE_STRING, label=proto.LABEL_OPTIONAL)
    error.field.add(name="message", number=2, type=proto.TYPE_STRING, label=proto.LABEL_OPTIONAL)
    reply.oneof_decl.add(name="outcome")
    reply.field.add(name="status", number=1, type=proto.TYPE_STRING, label=proto.LABEL_OPTIONAL)
    reply.field.add(name="result", number=2, type=proto.TYPE_STRING, label=proto.LABEL_OPTIONAL, oneof_index=0)
    reply.field.add(name="embedding", number=3, type=proto.TYPE_BYTES, label=proto.LABEL_OPTIONAL, oneof_index=0)
    reply.field.add(name="error", number=4, type=proto.TYPE_MESSAGE, label=proto.LABEL_OPTIONAL, oneof_index=0,
                    type_name=".kinference.Reply.Error")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    reply_class: type = message_factory.GetMessageClass(pool.FindMessageTypeByName(REPLY_NAME))
    return reply_class


ProtobufReply = _protobuf_reply()


def embedding_bytes(result: Any) -> bytes | None:
    """The little-endian float32 bytes of an embedding result (``{"embedding": 1-D float array}``, as the
    embedding handler returns it); None for any other result."""
    if not isinstance(result, dict) or result.keys() != {"embedding"}:
        return None
    embedding = result["embedding"]
    if not isinstance(embedding, np.ndarray) or embedding.ndim != 1 or embedding.dtype.kind != "f":
        return None
    return embedding.astype("<f4", copy=False).tobytes()


def reply_record(result: Any = None, error: tuple[ErrorCode, str] | None = None, *,
                 embedding: bool = True) -> dict[str, Any]:
    """The reply as a dict of ``kinference.Reply`` fields; ``embedding=False`` (JSON Schema) keeps the result as
    JSON data instead of bytes or text."""
    if error is not None:
        return {"status": "error", "error": {"code": str(error[0]), "message": error[1]}}
    json = orjson.dumps(result, option=orjson.OPT_SERIALIZE_NUMPY)
    if not embedding:
        return {"status": "ok", "result": orjson.loads(json)}
    vector = embedding_bytes(result)
    return {"status": "ok", "embedding": vector} if vector is not None else {"status": "ok", "result": json.decode()}


@dataclass(eq=False)
class SchemaReply:
    """The ``ReplyFormat`` of one request: its reply as a ``kinference.Reply`` record for its reply topic."""

    schemas: SchemaRegistryFormat
    topic: str
    value_headers: Headers = field(default_factory=list)
    """The headers the last value written needs beside it: its schema id, with ``schema_id_location`` header."""

    def response(self, result: Any) -> bytes:
        try:
            return self._write(result=result)
        except Exception as exc:  # a registry outage, or a result the schema cannot hold: this request's error
            raise RequestError(f"the reply could not be written as {self.schemas.name}: {exc}",
                               ErrorCode.INTERNAL_ERROR) from exc

    def error(self, code: ErrorCode, message: str) -> bytes:
        try:
            return self._write(error=(code, message))
        except Exception:
            # The publisher thread must answer the request all the same: kinference's JSON error, whose code the
            # kinference-error-code header carries too, rather than no reply at all.
            log.exception("an error reply to %s could not be written as %s; it goes as kinference's JSON",
                          self.topic, self.schemas.name)
            self.value_headers = []
            return encode_error(code, message)

    def _write(self, result: Any = None, error: tuple[ErrorCode, str] | None = None) -> bytes:
        headers: Headers = []
        value = self.schemas.write(self.topic, headers, result, error)
        self.value_headers = headers
        return value


class SchemaRegistryFormat:
    """The Schema Registry serdes of one ``--value-format``, shared by the service's threads."""

    def __init__(self, value_format: str, client: SchemaRegistryClient, subject_name_strategy: str = "topic",
                 schema_id_location: str = "prefix", auto_register: bool = True,
                 limits: SchemaLimits | None = None) -> None:
        if value_format not in _FORMAT_NAMES:
            raise ValueError(f"value_format must be one of {', '.join(_FORMAT_NAMES)}, not {value_format!r}")
        self.value_format = value_format
        self.name = _FORMAT_NAMES[value_format]
        self.client = client
        strategy = _STRATEGIES[subject_name_strategy]
        self._read_conf = {"subject.name.strategy": strategy, "schema.id.deserializer": dual_schema_id_deserializer}
        self._write_conf = {
            "subject.name.strategy": strategy,
            "auto.register.schemas": auto_register,
            "schema.id.serializer": (header_schema_id_serializer if schema_id_location == "header"
                                     else prefix_schema_id_serializer),
        }
        self.limits = limits or SchemaLimits()
        self._lookups = schemaids.SchemaLookups(self.limits.miss_ttl_s)
        self._held = _HeldBytes(self.limits.max_held_bytes, self.name)
        self._reader = self._deserializer()
        self._writers = threading.local()

    @classmethod
    def open(cls, config: ServiceConfig, payload_format: PayloadFormat) -> SchemaRegistryFormat:
        """The format of ``config``, checked against the registry for the default reply topic; ``ConfigError``
        when the handler does not take JSON payloads or the registry refuses."""
        if payload_format != "json":
            raise ConfigError(f"--value-format {config.value_format} hands the handler the decoded record (a dict): "
                              f"it needs a handler that takes JSON payloads, not {payload_format}")
        schemas = cls(config.value_format, SchemaRegistryClient.new_client(config.schema_registry_config()),
                      config.subject_name_strategy, config.schema_id_location, config.auto_register_schemas,
                      SchemaLimits(config.schema_registry_miss_ttl_s, config.max_in_flight_bytes))
        try:
            schemas.write(config.reply_topic, [], {}, None)
        except Exception as exc:
            raise ConfigError(f"the Schema Registry did not take kinference's reply schema ({REPLY_NAME}, "
                              f"{schemas.name}) for topic {config.reply_topic}: {exc}") from exc
        return schemas

    def decode(self, topic: str, value: bytes | None, headers: Headers) -> Any:
        """The handler's payload of a request value: the decoded record as a dict. Poll thread only."""
        if not value:
            raise RequestError(f"request value is empty; expected a {self.name} record", ErrorCode.BAD_REQUEST)
        context = SerializationContext(topic, MessageField.VALUE, _context_headers(headers))
        self._held.reading(len(value))
        try:
            key = schemaids.schema_id(value, headers, message_indexes=self.value_format == "protobuf")
            record = self._lookups.read(key, lambda: self._read(value, context), _lookup_error)
        except RequestError:
            raise  # the value, its schema or its id is past a bound, or its id is unknown: the reason is the message
        except Exception as exc:
            lookup = _lookup_error(exc)
            if lookup is not None:
                raise lookup from exc
            raise RequestError(f"the request value is not {self.name} in the Schema Registry's wire "
                               f"format: {exc}", ErrorCode.BAD_REQUEST) from exc
        if not isinstance(record, dict):
            raise RequestError(f"the request is a {self.name} {type(record).__name__}; expected a record",
                               ErrorCode.BAD_REQUEST)
        return record

    def held_bytes(self, value: bytes) -> int:
        """About what the record ``decode`` just returned for ``value`` holds, its bytes included: at most its
        schema's bound (Avro: ``schemabounds.AvroHeld``; Protobuf: ``schemabounds.PROTOBUF_PER_BYTE``), or, JSON
        Schema, as kinference's JSON is estimated. Poll thread only."""
        if self.value_format == "jsonschema":
            return jsonscan.decoded_bytes(value)
        return self._held.held

    def _read(self, value: bytes, context: SerializationContext) -> Any:
        with jsonscan.collector_paused():  # a wide record makes as many lists or dicts as a wide JSON value
            return self._reader(value, context)

    def reply(self, topic: str) -> SchemaReply:
        return SchemaReply(self, topic)

    def write(self, topic: str, headers: Headers, result: Any, error: tuple[ErrorCode, str] | None) -> bytes:
        """A ``kinference.Reply`` value for ``topic``; the schema id header, if any, is added to ``headers``."""
        record = reply_record(result, error, embedding=self.value_format != "jsonschema")
        if self.value_format == "protobuf":
            record = ProtobufReply(**record)
        return self._serializer()(record, SerializationContext(topic, MessageField.VALUE, _context_headers(headers)))

    def _serializer(self) -> Callable[[Any, SerializationContext], bytes]:
        writer: Callable[[Any, SerializationContext], bytes] | None = getattr(self._writers, "serializer", None)
        if writer is None:
            if self.value_format == "avro":
                writer = AvroSerializer(self.client, AVRO_REPLY, conf=self._write_conf)
            elif self.value_format == "protobuf":
                writer = ProtobufSerializer(ProtobufReply, self.client, conf=self._write_conf)
            else:
                writer = JSONSerializer(JSON_SCHEMA_REPLY, self.client, conf=self._write_conf)
            self._writers.serializer = writer
        return writer

    def _deserializer(self) -> Callable[[bytes, SerializationContext], Any]:
        if self.value_format == "avro":
            schemabounds.register_nesting_limit()
            return BoundedAvroDeserializer(self.client, self._read_conf, self._held)
        if self.value_format == "protobuf":
            return ProtobufRecords(self.client, self._read_conf, self._held)
        # Not validated against the writer's schema again: its producer's serializer did, and jsonschema takes a
        # Python step per element (a 957 KB array of empty arrays: 3 s of the poll thread). Parsed and bounded in
        # depth as kinference's JSON is, the garbage collector waiting.
        reader: Callable[[bytes, SerializationContext], Any] = JSONDeserializer(
            None, schema_registry_client=self.client, conf={**self._read_conf, "validate": False},
            json_decode=jsonscan.loads_within_depth)
        return reader


@dataclass(frozen=True)
class SchemaLimits:
    """What the poll thread allows a Schema Registry record: ``miss_ttl_s``, how long an id the registry did not
    find is not asked about again (``schemaids.SchemaLookups``); ``max_held_bytes``, the most a record may hold
    decoded (the byte budget, ``--max-in-flight-bytes``: a record that could hold more never fits in it)."""

    miss_ttl_s: float = 30.0
    max_held_bytes: int = 2**63


class _HeldBytes:
    """What the record being decoded may hold, from its size and its schema's bound per byte: set by the deserializer
    once it has the schema, before it decodes, and refused there past ``max_bytes``."""

    def __init__(self, max_bytes: int, name: str) -> None:
        self.max_bytes = max_bytes
        self.name = name
        self.held = 0
        self._size = 0

    def reading(self, size: int) -> None:
        self._size = self.held = size

    def bound(self, per_byte: float, fixed: int = 0) -> None:
        """The schema of the record being read holds at most ``per_byte`` per byte, plus ``fixed``."""
        self.held = int(self._size * (1 + per_byte)) + fixed
        if self.held > self.max_bytes:
            raise RequestError(f"the request's {self.name} record of {self._size} bytes may hold up to {self.held} "
                               f"bytes decoded (its schema allows {per_byte:.0f} per byte), more than the whole byte "
                               f"budget (max_in_flight_bytes {self.max_bytes})", ErrorCode.PAYLOAD_TOO_LARGE)


class BoundedAvroDeserializer(AvroDeserializer):
    """confluent-kafka's Avro deserializer, reading each writer's schema as ``schemabounds.bounded_avro_schema``
    makes it: no value nests deeper than ``MAX_JSON_DEPTH`` levels, and an array's items take bytes; and charging the
    record what its schema allows it to hold (``schemabounds.AvroHeld``) before it is decoded. Its
    ``_get_parsed_schema`` (present since confluent-kafka 2.12, the pin .ci/lowest-versions.sh tests) parses each
    schema it reads with."""

    def __init__(self, client: SchemaRegistryClient, conf: dict[str, Any], held: _HeldBytes) -> None:
        self._bounded: dict[Any, tuple[Any, schemabounds.AvroHeld]] = {}
        self._held = held
        super().__init__(client, conf=conf)

    def _get_parsed_schema(self, schema: Any) -> Any:
        bounded = self._bounded.get(schema)
        if bounded is None:
            parsed = schemabounds.bounded_avro_schema(super()._get_parsed_schema(schema))
            bounded = self._bounded[schema] = (parsed, schemabounds.AvroHeld(parsed))
        parsed, held = bounded
        self._held.bound(held.per_byte, held.fixed)
        return parsed


def _lookup_error(exc: Exception) -> RequestError | None:
    """The request's error when ``exc`` is the registry's answer to a schema lookup (or its failure to answer);
    None when it is not the registry's."""
    if isinstance(exc, SchemaRegistryError):
        if exc.http_status_code is not None and 400 <= exc.http_status_code < 500:
            return RequestError(f"the request's schema is not in the Schema Registry: {exc}", ErrorCode.BAD_REQUEST)
        return RequestError(f"the Schema Registry failed to look up the request's schema: {exc}",
                            ErrorCode.INTERNAL_ERROR)  # the registry failed, not the record
    if isinstance(exc, HTTPError):
        return RequestError(f"the Schema Registry could not be reached for the request's schema: {exc!r}",
                            ErrorCode.INTERNAL_ERROR)
    return None


def _context_headers(headers: Headers) -> HeadersType:
    """``headers`` as a serializer's context takes them. Its type also allows str values and so, a list being
    invariant, does not take ``Headers``; the serializers only read them and add a schema id header (bytes)."""
    return cast("HeadersType", headers)


class ProtobufRecords:
    """Protobuf values as dicts, each parsed with its writer's schema from the registry.

    confluent-kafka's ``ProtobufDeserializer`` parses into a message class given at construction, but a request's
    schema is only known from the registry. So one deserializer per writer schema is made, with the message class
    built from that schema by the deserializer's own parsing (its ``_get_parsed_schema`` and ``_get_message_desc``,
    present since confluent-kafka 2.12, whose pin .ci/lowest-versions.sh tests).
    """

    def __init__(self, client: SchemaRegistryClient, conf: dict[str, Any], held: _HeldBytes) -> None:
        self._client = client
        self._conf = conf
        self._held = held
        self._probe = ProtobufDeserializer(ProtobufReply, conf, client)
        self._by_schema: dict[tuple[Any, ...], ProtobufDeserializer] = {}

    def __call__(self, value: bytes, context: SerializationContext) -> dict[str, Any]:
        schema_id = SchemaId(PROTOBUF_TYPE)
        dual_schema_id_deserializer(value, context, schema_id)
        key = (schema_id.id, schema_id.guid, tuple(schema_id.message_indexes or ()))
        deserializer = self._by_schema.get(key)
        if deserializer is None:
            schema = self._probe._get_writer_schema(schema_id, None, fmt="serialized")
            file_proto, pool = self._probe._get_parsed_schema(schema)
            descriptor = self._probe._get_message_desc(pool, pool.FindFileByName(file_proto.name),
                                                       schema_id.message_indexes or [0])
            message_class = message_factory.GetMessageClass(descriptor)
            deserializer = self._by_schema[key] = ProtobufDeserializer(message_class, self._conf, self._client)
        self._held.bound(schemabounds.PROTOBUF_PER_BYTE)
        message = deserializer(value, context)
        return schemabounds.message_to_dict(message)
