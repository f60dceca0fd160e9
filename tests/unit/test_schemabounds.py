"""Schema Registry values bounded as JSON values are (``consumer.schemabounds``, issue 29 item 4): nesting depth in
Avro and Protobuf, Avro arrays of items that take no bytes, and the Protobuf dict a field at a time, the same as
``json_format`` gives. Decoded through ``RequestDecoder`` with confluent-kafka's in-memory registry."""

from __future__ import annotations

import json
import math
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
from kinference.consumer.wire.schemabounds import TOO_DEEP, is_repeated, message_to_dict
from kinference.consumer.wire.serdes import SchemaRegistryFormat
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
