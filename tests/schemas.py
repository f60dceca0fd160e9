"""A producer's side of ``--value-format``: text requests written with the producer's own schema (Avro, Protobuf,
JSON Schema) by confluent-kafka's serializers, and kinference's replies read back with its deserializers; and
``LocalRegistry``, a small Schema Registry that a ``kinference serve`` process can reach."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import orjson
from confluent_kafka.schema_registry import SchemaRegistryClient, header_schema_id_serializer
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.schema_registry.json_schema import JSONDeserializer, JSONSerializer
from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer, ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory

from kinference.consumer.wire.serdes import ProtobufReply

AVRO_TEXT = orjson.dumps({"type": "record", "name": "TextRequest", "namespace": "shop",
                          "fields": [{"name": "text", "type": "string"}]}).decode()
JSON_SCHEMA_TEXT = orjson.dumps({"$schema": "http://json-schema.org/draft-07/schema#", "title": "shop.TextRequest",
                                 "type": "object", "properties": {"text": {"type": "string"}},
                                 "required": ["text"]}).decode()


def _protobuf_text() -> type:
    """``package shop; message TextRequest { string text = 1; }``"""
    file = descriptor_pb2.FileDescriptorProto(name="shop/text.proto", package="shop", syntax="proto3")
    file.message_type.add(name="TextRequest").field.add(
        name="text", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
        label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("shop.TextRequest"))


ProtobufText = _protobuf_text()


class Producer:
    """Writes ``{"text": ...}`` requests as a producer with its own schema would, and reads kinference's replies."""

    def __init__(self, value_format: str, client: SchemaRegistryClient, header_ids: bool = False) -> None:
        self.value_format = value_format
        conf = {"schema.id.serializer": header_schema_id_serializer} if header_ids else {}
        if value_format == "avro":
            self._write = AvroSerializer(client, AVRO_TEXT, conf=conf)
            self._read = AvroDeserializer(client)
        elif value_format == "protobuf":
            self._write = ProtobufSerializer(ProtobufText, client, conf=conf)
            self._read = ProtobufDeserializer(ProtobufReply)
        else:
            self._write = JSONSerializer(JSON_SCHEMA_TEXT, client, conf=conf)
            self._read = JSONDeserializer(None, schema_registry_client=client)

    def request(self, topic: str, text: str, headers: list | None = None) -> bytes:
        record = ProtobufText(text=text) if self.value_format == "protobuf" else {"text": text}
        return self._write(record, SerializationContext(topic, MessageField.VALUE, headers))

    def reply(self, topic: str, value: bytes, headers: list | None = None) -> dict[str, Any]:
        """A reply as a dict of ``kinference.Reply`` fields (Protobuf bytes stay bytes)."""
        record = self._read(value, SerializationContext(topic, MessageField.VALUE, headers))
        if self.value_format != "protobuf":
            return record
        fields = json_format.MessageToDict(record, preserving_proto_field_name=True)
        if record.WhichOneof("outcome") == "embedding":
            fields["embedding"] = record.embedding
        return fields


class LocalRegistry:
    """A Schema Registry on 127.0.0.1 for tests that run ``kinference serve`` (a child process cannot reach
    confluent-kafka's in-memory ``mock://`` registry): the endpoints SchemaRegistryClient calls to register, look up
    and fetch schemas, each answer after ``delay_s`` (a registry across a network). ``asked`` counts the requests per
    path. Use as a context manager; its thread stops at the end."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.asked: Counter[str] = Counter()
        self._schemas: list[dict[str, Any]] = []
        """Each registered schema (id: its index + 1): schema, schemaType, references, guid."""
        self._subjects: dict[str, list[int]] = {}
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="local-registry", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> LocalRegistry:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def answer(self, method: str, path: str, body: dict[str, Any] | None) -> tuple[int, dict[str, Any]]:
        """The status and JSON body of one request."""
        parts = path.strip("/").split("/")
        with self._lock:
            if method == "GET" and parts[:2] == ["schemas", "ids"] and len(parts) == 3 and parts[2].isdigit():
                return self._by_id(int(parts[2]))
            if method == "GET" and parts[:2] == ["schemas", "guids"] and len(parts) == 3:
                found = [index for index, schema in enumerate(self._schemas) if schema["guid"] == parts[2]]
                return self._by_id(found[0] + 1) if found else _not_found(40403, "Schema not found")
            if parts[0] == "subjects" and len(parts) >= 2 and body is not None and method == "POST":
                return self._register(parts[1], body) if parts[2:] == ["versions"] else self._lookup(parts[1], body)
            if method == "GET" and parts[0] == "subjects" and parts[2:] == ["versions", "latest"]:
                versions = self._subjects.get(parts[1])
                if not versions:
                    return _not_found(40401, "Subject not found")
                return 200, self._registered(parts[1], versions[-1])
        return _not_found(404, f"{method} {path} is not served here")

    def _by_id(self, schema_id: int) -> tuple[int, dict[str, Any]]:
        if not 1 <= schema_id <= len(self._schemas):
            return _not_found(40403, "Schema not found")
        return 200, {**self._schemas[schema_id - 1], "id": schema_id}

    def _register(self, subject: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        schema = {"schema": body["schema"], "schemaType": body.get("schemaType", "AVRO"),
                  "references": body.get("references") or []}
        known = [index for index, held in enumerate(self._schemas)
                 if {key: held[key] for key in schema} == schema]
        if known:
            schema_id = known[0] + 1
        else:
            self._schemas.append({**schema, "guid": str(uuid.uuid4())})
            schema_id = len(self._schemas)
        versions = self._subjects.setdefault(subject, [])
        if schema_id not in versions:
            versions.append(schema_id)
        return 200, self._registered(subject, schema_id)

    def _lookup(self, subject: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        for schema_id in self._subjects.get(subject, []):
            if self._schemas[schema_id - 1]["schema"] == body["schema"]:
                return 200, self._registered(subject, schema_id)
        return _not_found(40403, "Schema not found")

    def _registered(self, subject: str, schema_id: int) -> dict[str, Any]:
        return {**self._schemas[schema_id - 1], "id": schema_id, "subject": subject,
                "version": self._subjects[subject].index(schema_id) + 1}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        registry = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._answer(None)

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self._answer(orjson.loads(self.rfile.read(length)) if length else {})

            def _answer(self, body: dict[str, Any] | None) -> None:
                path = self.path.split("?")[0]
                registry.asked[path] += 1
                time.sleep(registry.delay_s)
                status, answer = registry.answer(self.command, path, body)
                data = orjson.dumps(answer)
                self.send_response(status)
                self.send_header("Content-Type", "application/vnd.schemaregistry.v1+json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_args: object) -> None:
                pass  # quiet: tests read ``asked``

        return Handler


def _not_found(code: int, message: str) -> tuple[int, dict[str, Any]]:
    return 404, {"error_code": code, "message": message}
