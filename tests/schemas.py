"""A producer's side of ``--value-format``: text requests written with the producer's own schema (Avro, Protobuf,
JSON Schema) by confluent-kafka's serializers, and kinference's replies read back with its deserializers."""

from __future__ import annotations

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
