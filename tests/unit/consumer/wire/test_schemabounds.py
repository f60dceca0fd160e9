"""Schema Registry values bounded as JSON values are (``consumer.schemabounds``, issue 29 item 4): nesting depth in
Avro and Protobuf, Avro arrays of items that take no bytes, and the Protobuf dict a field at a time, the same as
``json_format`` gives. Decoded through ``RequestDecoder`` with confluent-kafka's in-memory registry."""

from __future__ import annotations

import json
import math
import time
import uuid

import numpy as np
import orjson
import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.schema_registry.json_schema import JSONSerializer
from confluent_kafka.schema_registry.protobuf import ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from google.protobuf import (
    any_pb2,
    descriptor_pb2,
    descriptor_pool,
    duration_pb2,
    json_format,
    message_factory,
    struct_pb2,
    timestamp_pb2,
    wrappers_pb2,
)
from google.protobuf.internal import type_checkers

from kinference.consumer.path.request import RequestDecoder
from kinference.consumer.wire.schemabounds import PROTOBUF_PER_BYTE, TOO_DEEP, is_repeated, message_to_dict
from kinference.consumer.wire.serdes import SchemaLimits, SchemaRegistryFormat
from kinference.errors import RequestError
from kinference.protocol import MAX_JSON_DEPTH, ErrorCode
from tests.fakes import FakeRecord

CONTEXT = SerializationContext("requests", MessageField.VALUE)
FIELD = descriptor_pb2.FieldDescriptorProto
NODE = {"type": "record", "name": "Node", "namespace": "shop",
        "fields": [{"name": "child", "type": ["null", "Node"]}, {"name": "v", "type": "int"}]}


def registry() -> SchemaRegistryClient:
    return SchemaRegistryClient.new_client({"url": f"mock://{uuid.uuid4().hex}"})


def _avro(schema: dict) -> tuple[AvroSerializer, RequestDecoder]:
    client = registry()
    return (AvroSerializer(client, orjson.dumps(schema).decode()),
            RequestDecoder("replies", 960_000, schemas=SchemaRegistryFormat("avro", client)))


def _avro_chain(depth: int) -> bytes:
    """A ``shop.Node`` value ``depth`` records deep, as Avro writes it: each level the union's index 1, then the
    innermost's null child and value, then each level's value 1."""
    return b"\x02" * (depth - 1) + b"\x00\x02" + b"\x02" * (depth - 1)


def _chain(depth: int, leaf: object = None) -> dict:
    node: dict = {"child": leaf, "v": 1}
    for _ in range(depth - 1):
        node = {"child": node, "v": 1}
    return node


def test_an_avro_value_nested_within_the_limit_decodes_as_before_one_deeper_is_a_bad_request():
    """Before, a recursive schema was read as deep as the value went: 100 records deep reached the handler, and a
    200 KB value 100,000 deep ended the process (a segmentation fault in fastavro's C reader)."""
    write, decoder = _avro(NODE)
    prefix = write({"child": None, "v": 1}, CONTEXT)[:5]
    assert decoder.decode(FakeRecord(prefix + _avro_chain(MAX_JSON_DEPTH))).payload == _chain(MAX_JSON_DEPTH)
    assert decoder.decode(FakeRecord(write(_chain(3), CONTEXT))).payload == _chain(3)
    for depth in (MAX_JSON_DEPTH + 1, 100, 100_000):
        request = decoder.decode(FakeRecord(prefix + _avro_chain(depth)))
        assert request.dead_letter and request.error.code is ErrorCode.BAD_REQUEST, depth
        assert request.error.message == TOO_DEEP


def test_avro_arrays_and_maps_count_as_levels_and_shared_types_keep_their_layout():
    """Arrays and maps nest as JSON's lists and objects do; a recursive schema whose types are used at several depths
    (and in one union) reads a shallow value exactly as the writer's own schema does."""
    schema = {"type": "record", "name": "Tree", "fields": [
        {"name": "kids", "type": {"type": "array", "items": "Tree"}},
        {"name": "tags", "type": {"type": "map", "values": {"type": "enum", "name": "Tag", "symbols": ["A", "B"]}}},
        {"name": "other", "type": ["null", "Tree", {"type": "fixed", "name": "Id", "size": 2}]},
        {"name": "id", "type": ["null", "Id"]}]}
    write, decoder = _avro(schema)
    leaf = {"kids": [], "tags": {"x": "B"}, "other": b"ab", "id": b"cd"}
    tree = {"kids": [leaf, {"kids": [leaf], "tags": {}, "other": leaf, "id": None}], "tags": {"y": "A"},
            "other": None, "id": b"ef"}
    assert decoder.decode(FakeRecord(write(tree, CONTEXT))).payload == tree
    deep: dict = leaf
    for _ in range(MAX_JSON_DEPTH // 2):  # each level a record and its array
        deep = {"kids": [deep], "tags": {}, "other": None, "id": None}
    request = decoder.decode(FakeRecord(write(deep, CONTEXT)))
    assert request.error.code is ErrorCode.BAD_REQUEST and request.error.message == TOO_DEEP


@pytest.mark.parametrize("items", ["null", {"type": "record", "name": "Nothing", "fields": []},
                                   {"type": "fixed", "name": "None0", "size": 0}])
def test_an_avro_array_of_items_that_take_no_bytes_is_refused(items):
    """Five bytes made ten million nulls (0.5 s of the poll thread), and a count of 2**62 never ended."""
    write, decoder = _avro({"type": "record", "name": "Many", "fields": [
        {"name": "a", "type": {"type": "array", "items": items}}]})
    prefix = write({"a": []}, CONTEXT)[:5]
    request = decoder.decode(FakeRecord(prefix + b"\x80\xda\xc4\x09\x00"))  # a block of 10,000,000, then the end
    assert request.dead_letter and request.error.code is ErrorCode.BAD_REQUEST
    assert "items that take no bytes" in request.error.message


def _messages() -> dict[str, type]:
    """``shop.Node {Node child = 1; int32 v = 2;}`` and ``shop.Every``, a field of each kind JSON maps."""
    file = descriptor_pb2.FileDescriptorProto(name=f"shop/{uuid.uuid4().hex}.proto", package="shop", syntax="proto3",
                                              dependency=["google/protobuf/struct.proto", "google/protobuf/any.proto",
                                                          "google/protobuf/timestamp.proto",
                                                          "google/protobuf/duration.proto",
                                                          "google/protobuf/wrappers.proto"])
    node = file.message_type.add(name="Node")
    node.field.add(name="child", number=1, type=FIELD.TYPE_MESSAGE, type_name=".shop.Node")
    node.field.add(name="v", number=2, type=FIELD.TYPE_INT32)
    file.enum_type.add(name="Color").value.extend([descriptor_pb2.EnumValueDescriptorProto(name="RED", number=0),
                                                   descriptor_pb2.EnumValueDescriptorProto(name="BLUE", number=1)])
    every = file.message_type.add(name="Every")
    entry = every.nested_type.add(name="WeightsEntry", options=descriptor_pb2.MessageOptions(map_entry=True))
    entry.field.add(name="key", number=1, type=FIELD.TYPE_INT64)
    entry.field.add(name="value", number=2, type=FIELD.TYPE_MESSAGE, type_name=".shop.Node")
    scores = every.nested_type.add(name="ScoresEntry", options=descriptor_pb2.MessageOptions(map_entry=True))
    scores.field.add(name="key", number=1, type=FIELD.TYPE_BOOL)
    scores.field.add(name="value", number=2, type=FIELD.TYPE_FLOAT)
    scalars = [FIELD.TYPE_DOUBLE, FIELD.TYPE_FLOAT, FIELD.TYPE_INT64, FIELD.TYPE_UINT64, FIELD.TYPE_INT32,
               FIELD.TYPE_FIXED64, FIELD.TYPE_FIXED32, FIELD.TYPE_BOOL, FIELD.TYPE_STRING, FIELD.TYPE_BYTES,
               FIELD.TYPE_UINT32, FIELD.TYPE_SFIXED32, FIELD.TYPE_SFIXED64, FIELD.TYPE_SINT32, FIELD.TYPE_SINT64]
    number = 0
    for kind in scalars:
        for label in (FIELD.LABEL_OPTIONAL, FIELD.LABEL_REPEATED):
            number += 1
            every.field.add(name=f"f{number}", number=number, type=kind, label=label)
    for name, type_name in [("color", ".shop.Color"), ("node", ".shop.Node"), ("struct", ".google.protobuf.Struct"),
                            ("value", ".google.protobuf.Value"), ("list", ".google.protobuf.ListValue"),
                            ("any", ".google.protobuf.Any"), ("when", ".google.protobuf.Timestamp"),
                            ("took", ".google.protobuf.Duration"), ("wrapped", ".google.protobuf.Int64Value")]:
        for label in (FIELD.LABEL_OPTIONAL, FIELD.LABEL_REPEATED):
            number += 1
            kind = FIELD.TYPE_ENUM if name == "color" else FIELD.TYPE_MESSAGE
            every.field.add(name=f"{name}{number}", number=number, type=kind, label=label, type_name=type_name)
    every.field.add(name="weights", number=number + 1, type=FIELD.TYPE_MESSAGE, label=FIELD.LABEL_REPEATED,
                    type_name=".shop.Every.WeightsEntry")
    every.field.add(name="scores", number=number + 2, type=FIELD.TYPE_MESSAGE, label=FIELD.LABEL_REPEATED,
                    type_name=".shop.Every.ScoresEntry")
    pool = descriptor_pool.Default()  # where Any's messages are found, as json_format finds them
    pool.Add(file)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"shop.{name}"))
            for name in ("Node", "Every")}


MESSAGES = _messages()


def _every() -> object:
    every = MESSAGES["Every"]()
    floats = [0.1, -2.5, 1e-7, 3.4e38, 1e-40, math.inf, -math.inf, math.nan, 123456.789, 0.0]
    for field in every.DESCRIPTOR.fields:
        if field.name == "weights":
            every.weights[7].v = 3
            every.weights[-8].SetInParent()
            continue
        if field.name == "scores":
            every.scores[True] = 0.1
            every.scores[False] = math.inf
            continue
        target = getattr(every, field.name)
        kind = field.type
        if kind == FIELD.TYPE_MESSAGE:
            samples = _well_known(field.message_type.full_name)
            if is_repeated(field):
                target.extend(samples)
            else:
                target.CopyFrom(samples[0])
            continue
        samples = {FIELD.TYPE_DOUBLE: floats, FIELD.TYPE_FLOAT: floats, FIELD.TYPE_BOOL: [True, False],
                   FIELD.TYPE_STRING: ["", "é", "ab"], FIELD.TYPE_BYTES: [b"", b"\x00\xff", b"abc"],
                   FIELD.TYPE_ENUM: [0, 1, 7]}.get(kind, [0, 1, 2**31 - 1])
        if kind in (FIELD.TYPE_INT64, FIELD.TYPE_SINT64, FIELD.TYPE_SFIXED64):
            samples = [-(2**63), 2**53 + 1, 5]
        if is_repeated(field):
            target.extend(samples)
        else:
            setattr(every, field.name, samples[1])
    return every


def _well_known(name: str) -> list:
    node = MESSAGES["Node"](v=2, child=MESSAGES["Node"](v=1))
    packed = any_pb2.Any()
    packed.Pack(node)
    wrapped = any_pb2.Any()
    wrapped.Pack(wrappers_pb2.Int64Value(value=9))
    struct = struct_pb2.Struct()
    struct.update({"a": [1, "x", None, {"b": True}], "c": {}})
    return {
        "shop.Node": [node, MESSAGES["Node"]()],
        "google.protobuf.Struct": [struct, struct_pb2.Struct()],
        "google.protobuf.Value": [struct_pb2.Value(string_value="s"), struct_pb2.Value(null_value=0),
                                  struct_pb2.Value(list_value=struct_pb2.ListValue())],
        "google.protobuf.ListValue": [struct_pb2.ListValue(values=[struct_pb2.Value(number_value=1.5)])],
        "google.protobuf.Any": [packed, wrapped, any_pb2.Any()],
        "google.protobuf.Timestamp": [timestamp_pb2.Timestamp(seconds=1_700_000_000, nanos=5)],
        "google.protobuf.Duration": [duration_pb2.Duration(seconds=3, nanos=500_000_000)],
        "google.protobuf.Int64Value": [wrappers_pb2.Int64Value(value=2**40), wrappers_pb2.Int64Value()],
    }[name]


def test_a_protobuf_message_becomes_the_dict_json_format_makes_of_it():
    every = _every()
    expected = json_format.MessageToDict(every, preserving_proto_field_name=True)
    assert message_to_dict(every) == expected
    assert json.dumps(message_to_dict(every)) == json.dumps(expected)  # NaN too, and floats digit for digit


def test_floats_are_the_shortest_decimal_that_narrows_back_as_json_format_writes_them():
    """The shortest decimal of each float is found in C; json_format's Python loop is the reference. Only a value
    that is a tie or subnormal may differ in its last digit, and then narrows back to the same float."""
    bits = np.random.default_rng(29).integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    floats = bits.view(np.float32)
    floats = floats[np.isfinite(floats)]
    message = MESSAGES["Every"]()
    message.f4.extend(floats.tolist())  # repeated float
    got = message_to_dict(message)["f4"]
    expected = [type_checkers.ToShortestFloat(value) for value in floats.tolist()]
    differ = [(a, b) for a, b in zip(got, expected, strict=True) if a != b]
    assert np.array_equal(np.float32(got), np.float32(expected))
    normal = np.abs(floats) >= np.finfo(np.float32).tiny
    assert len(differ) <= len(floats) // 10_000 + int((~normal).sum()), differ[:5]


def test_a_protobuf_value_nested_deeper_than_the_limit_is_a_bad_request():
    """Before, Protobuf values nested as deep as upb parses (100 messages) reached the handler."""
    client = registry()
    write = ProtobufSerializer(MESSAGES["Node"], client, conf={"use.deprecated.format": False})
    decoder = RequestDecoder("replies", 960_000, schemas=SchemaRegistryFormat("protobuf", client))

    def chain(depth: int) -> object:
        node = MESSAGES["Node"](v=1)
        for _ in range(depth - 1):
            node = MESSAGES["Node"](child=node, v=1)
        return node

    assert decoder.decode(FakeRecord(write(chain(MAX_JSON_DEPTH), CONTEXT))).ok
    for depth in (MAX_JSON_DEPTH + 1, 99):
        request = decoder.decode(FakeRecord(write(chain(depth), CONTEXT)))
        assert request.dead_letter and request.error.code is ErrorCode.BAD_REQUEST, depth
        assert request.error.message == TOO_DEEP
    nested = struct_pb2.Struct()
    inner = nested.get_or_create_list("a")  # lists in lists, each level a Value and a ListValue message
    for _ in range(MAX_JSON_DEPTH - 2):
        inner = inner.add_list()
    assert message_to_dict(nested)
    inner.add_list()
    with pytest.raises(RequestError, match="deeper than 64 levels"):
        message_to_dict(nested)


def test_a_json_schema_record_nested_deeper_than_the_limit_is_a_bad_request():
    """Before, a JSON Schema record was parsed without the depth check of kinference's JSON: 100 deep reached the
    handler."""
    client = registry()
    schema = orjson.dumps({"$schema": "http://json-schema.org/draft-07/schema#", "title": "Deep", "type": "object"})
    write = JSONSerializer(schema.decode(), client)
    decoder = RequestDecoder("replies", 960_000, schemas=SchemaRegistryFormat("jsonschema", client))
    for depth, ok in ((MAX_JSON_DEPTH, True), (MAX_JSON_DEPTH + 1, False), (100, False)):
        deep: object = {}
        for _ in range(depth - 1):
            deep = {"a": deep}
        request = decoder.decode(FakeRecord(write(deep, CONTEXT)))
        assert request.ok == ok, depth
        if not ok:
            assert request.dead_letter and request.error.code is ErrorCode.BAD_REQUEST
            assert request.error.message == TOO_DEEP


def _held_in_memory(decode) -> int:
    """What ``decode()``'s result holds, measured with tracemalloc."""
    import gc
    import tracemalloc

    gc.collect()
    tracemalloc.start()
    try:
        result = decode()
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert result is not None
    return held


@pytest.mark.parametrize(("items", "element"), [
    ({"type": "record", "name": "Flag", "fields": [{"name": "b", "type": "boolean"}]}, {"b": True}),
    ("int", -60),
    ("string", "\u0100"),
    (["null", {"type": "record", "name": "Empty", "fields": []}], {}),
    ({"type": "map", "values": "null"}, {"k": None}),
    ({"type": "array", "items": "boolean"}, [True]),
], ids=["records", "ints", "strings", "union", "maps", "arrays"])
def test_an_avro_record_is_charged_at_least_what_it_holds_decoded(items, element):
    """Issue 36: one 900 KB ``array<record{boolean}>`` held 173 MB decoded (192x its bytes) and was charged 36 MB
    (40x, every Avro value's charge): a service with a 256 MiB budget grew by 1,463 MB. Now each record is charged
    its schema's bound (``AvroHeld``), which is never below what it holds, nor above three times it for these
    shapes."""
    import io

    import fastavro

    write, decoder = _avro({"type": "record", "name": "Wide", "fields": [
        {"name": "a", "type": {"type": "array", "items": items}}]})
    value = write({"a": [element] * 1000}, CONTEXT)
    count = 900_000 * 1000 // len(value)
    value = write({"a": [element] * count}, CONTEXT)
    request = decoder.decode(FakeRecord(value))
    assert request.ok
    parsed = fastavro.parse_schema(orjson.loads(decoder.schemas.client.get_schema(1).schema_str))
    held = _held_in_memory(lambda: fastavro.schemaless_reader(io.BytesIO(value[5:]), parsed))
    assert held + len(value) <= request.held_bytes < 3 * held + 4 * len(value), (held, request.held_bytes)


def test_an_avro_record_that_could_hold_more_than_the_byte_budget_is_refused_before_it_is_decoded():
    client = registry()
    schema = {"type": "record", "name": "Flags", "fields": [{"name": "a", "type": {"type": "array", "items": {
        "type": "record", "name": "Flag", "fields": [{"name": "b", "type": "boolean"}]}}}]}
    write = AvroSerializer(client, orjson.dumps(schema).decode())
    value = write({"a": [{"b": True}] * 900_000}, CONTEXT)
    limits = SchemaLimits(max_held_bytes=64 * 2**20)
    decoder = RequestDecoder("replies", 960_000, schemas=SchemaRegistryFormat("avro", client, limits=limits))
    started = time.perf_counter()
    request = decoder.decode(FakeRecord(value))
    took = time.perf_counter() - started
    assert request.dead_letter and request.error.code is ErrorCode.PAYLOAD_TOO_LARGE
    assert "more than the whole byte budget" in request.error.message
    assert took < 0.05, f"refused after {took:.3f} s: decoded first"  # decoding it takes ~0.2 s
    small = decoder.decode(FakeRecord(write({"a": [{"b": True}] * 1000}, CONTEXT)))
    assert small.ok and small.payload == {"a": [{"b": True}] * 1000}


def test_a_protobuf_record_is_charged_its_bound_per_byte():
    client = registry()
    write = ProtobufSerializer(MESSAGES["Node"], client, conf={"use.deprecated.format": False})
    value = write(MESSAGES["Node"](v=1), CONTEXT)
    request = RequestDecoder("replies", 960_000, schemas=SchemaRegistryFormat("protobuf", client)).decode(
        FakeRecord(value))
    assert request.ok and request.held_bytes == len(value) * (1 + PROTOBUF_PER_BYTE)


def _protobuf_prefix(client) -> bytes:
    """The magic byte and schema id of a registered ``shop.Node``."""
    write = ProtobufSerializer(MESSAGES["Node"], client, conf={"use.deprecated.format": False})
    return write(MESSAGES["Node"](v=1), CONTEXT)[:5]


@pytest.mark.parametrize(("indexes", "why"), [
    (b"\xc0\x9a\x0c" + b"\x00" * 100_000, "lists 100000 message indexes"),  # zigzag 100,000, then 100,000 zeros
    (b"\x02" + b"\xff" * 100_000 + b"\x00", "longer than a varint's ten bytes"),  # one index, 100,000 bytes long
])
def test_a_protobuf_prefix_of_many_message_indexes_is_refused_in_time_small_in_the_prefix(indexes, why):
    """Issue 36: 60 values whose prefix listed 100,000 message indexes were each refused after ~50 ms of the poll
    thread (confluent-kafka reads them all, a Python step each, before it looks at the schema); a neighbour waited
    up to 3 s. Now the count is bounded (a schema nests its messages at most ``MAX_JSON_DEPTH`` deep) and each
    index is a varint of at most ten bytes, checked before the deserializer reads any."""
    client = registry()
    decoder = RequestDecoder("replies", 960_000, schemas=SchemaRegistryFormat("protobuf", client))
    value = _protobuf_prefix(client) + indexes + b"\x10\x01"
    started = time.perf_counter()
    for _ in range(10):
        request = decoder.decode(FakeRecord(value))
    each = (time.perf_counter() - started) / 10
    assert request.dead_letter and request.error.code is ErrorCode.BAD_REQUEST
    assert why in request.error.message
    assert each < 0.005, f"{each * 1000:.1f} ms per value"
    header = [("__value_schema_id", b"\x01" + uuid.uuid4().bytes + indexes[:3000])]
    request = decoder.decode(FakeRecord(b"\x10\x01", header))  # the same prefix in the header
    assert request.dead_letter and why.split()[0] in request.error.message


def test_a_protobuf_prefix_within_the_bound_still_names_its_message():
    client = registry()
    prefix = _protobuf_prefix(client)
    decoder = RequestDecoder("replies", 960_000, schemas=SchemaRegistryFormat("protobuf", client))
    assert decoder.decode(FakeRecord(prefix + b"\x00\x10\x01")).payload == {"v": 1}  # no indexes: the first message
    assert decoder.decode(FakeRecord(prefix + b"\x02\x00\x10\x01")).payload == {"v": 1}  # one: [0]
