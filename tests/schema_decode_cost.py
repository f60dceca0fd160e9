"""What the poll thread's decode of a Schema Registry value costs, in µs per KB of value, by shape: the numbers of
docs/guarantees.md (issue 29, item 4). Not a test: ``python -m tests.schema_decode_cost [BYTES]`` prints a table,
kinference's JSON list of short strings first for reference (compare within one run: a loaded machine moves all).
Against confluent-kafka's in-memory registry; the fastest of five runs of each."""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Callable

import orjson
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.schema_registry.protobuf import ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from kinference.consumer.path.request import RequestDecoder
from kinference.consumer.wire.serdes import SchemaRegistryFormat
from tests.fakes import FakeRecord

CONTEXT = SerializationContext("requests", MessageField.VALUE)
FIELD = descriptor_pb2.FieldDescriptorProto


def wide_message() -> type:
    """``bench.Wide``: a repeated field of each kind measured, and ``repeated Empty empties = 7``."""
    file = descriptor_pb2.FileDescriptorProto(name="bench/wide.proto", package="bench", syntax="proto3")
    file.message_type.add(name="Empty")
    wide = file.message_type.add(name="Wide")
    for number, (name, kind) in enumerate([("floats", FIELD.TYPE_FLOAT), ("doubles", FIELD.TYPE_DOUBLE),
                                           ("ints", FIELD.TYPE_INT32), ("longs", FIELD.TYPE_INT64),
                                           ("strings", FIELD.TYPE_STRING), ("blobs", FIELD.TYPE_BYTES)], 1):
        wide.field.add(name=name, number=number, type=kind, label=FIELD.LABEL_REPEATED)
    wide.field.add(name="empties", number=7, type=FIELD.TYPE_MESSAGE, label=FIELD.LABEL_REPEATED,
                   type_name=".bench.Empty")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("bench.Wide"))


def cost(decoder: RequestDecoder, value: bytes) -> float:
    """µs per KB of ``value``'s decode, the fastest of five."""
    assert decoder.decode(FakeRecord(value)).ok
    fastest = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        decoder.decode(FakeRecord(value))
        fastest = min(fastest, time.perf_counter() - started)
    return fastest * 1e6 / (len(value) / 1000)


def shapes(size: int) -> list[tuple[str, RequestDecoder, bytes]]:
    client = SchemaRegistryClient.new_client({"url": f"mock://{uuid.uuid4().hex}"})
    protobuf = RequestDecoder("replies", 2 * size, schemas=SchemaRegistryFormat("protobuf", client))
    wide = wide_message()
    write: Callable[..., bytes] = ProtobufSerializer(wide, client, conf={"use.deprecated.format": False})
    rows = [("json [\"ab\",...] (reference)", RequestDecoder("replies", 2 * size),
             b"[" + b",".join([b'"ab"'] * (size // 5)) + b"]")]
    rows += [(f"protobuf repeated {name}", protobuf, write(wide(**{name: values}), CONTEXT)) for name, values in [
        ("floats", [0.1 * i for i in range(size // 4)]), ("doubles", [0.1 * i for i in range(size // 8)]),
        ("ints", list(range(size // 3))), ("longs", list(range(size // 3))), ("strings", ["ab"] * (size // 4)),
        ("blobs", [b"ab"] * (size // 4)), ("empties", [{}] * (size // 2))]]
    for name, items, record in [("floats", "float", [0.1] * (size // 4)), ("ints", "int", [1] * size),
                                ("strings", "string", ["ab"] * (size // 3)),
                                ("empty arrays", {"type": "array", "items": "int"}, [[]] * size)]:
        client = SchemaRegistryClient.new_client({"url": f"mock://{uuid.uuid4().hex}"})
        schema = {"type": "record", "name": "A", "fields": [{"name": "a", "type": {"type": "array", "items": items}}]}
        value = AvroSerializer(client, orjson.dumps(schema).decode())({"a": record}, CONTEXT)
        rows.append((f"avro array of {name}", RequestDecoder("replies", 2 * size,
                                                             schemas=SchemaRegistryFormat("avro", client)), value))
    return rows


def main() -> None:
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 480_000
    for name, decoder, value in shapes(size):
        print(f"{name:32s} {len(value) / 1000:7.1f} KB {cost(decoder, value):8.1f} µs/KB")


if __name__ == "__main__":
    main()
