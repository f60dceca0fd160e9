"""Schema Registry values bounded as kinference's JSON values are (``jsonscan``): nesting at most ``MAX_JSON_DEPTH``
levels of arrays and objects, and a decode whose cost grows with the value's bytes, never faster.

Avro: fastavro decodes in C, one recursive call per nesting level with no check of the stack, so a 200 KB value of a
recursive schema (``record Node {union {null, Node} child}``, 100,000 deep) ended the process with a segmentation
fault; and an array whose items take no bytes (``null``, an empty record) made ten million items of five bytes.
Both are read from the writer's schema, once per schema: a schema that can nest deeper than the limit is decoded
with its recursion unrolled to the limit, where a type that raises when read (``_NESTING_LIMIT``) stands for what
would nest deeper, and a schema with an array of items that take no bytes is refused.

What an Avro value holds decoded is bounded from its writer's schema too (``AvroHeld``): a 900 KB array of
one-boolean records held 173 MB decoded (192x its bytes), five times the 40x charged to every Avro value before.

Protobuf: ``message_to_dict`` is the proto3 JSON mapping of ``json_format.MessageToDict`` (``.proto`` field names),
with a repeated scalar field converted a field at a time in C (``json_format`` takes a Python step per element,
~850 µs per KB of packed floats, ~30 now) and the nesting counted as it goes.
"""

from __future__ import annotations

import base64
import math
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
from fastavro import parse_schema
from fastavro.read import LOGICAL_READERS
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.internal import type_checkers
from google.protobuf.message import Message

from kinference.consumer.wire.jsonscan import TOO_DEEP
from kinference.errors import RequestError
from kinference.protocol import MAX_JSON_DEPTH, ErrorCode

# --- Avro

_NESTING_LIMIT = "kinference-nesting-limit"
"""The logical type of what stands for a record, array or map that would nest deeper than the limit: a fixed of no
bytes, whose reader raises. Named after the type it replaces, so that a union keeps one branch per type."""
_CONTAINERS = frozenset(("record", "error", "array", "map"))


def _too_deep(_value: Any, *_schemas: Any) -> Any:
    raise RequestError(TOO_DEEP, ErrorCode.BAD_REQUEST)


def register_nesting_limit() -> None:
    """Make fastavro raise ``TOO_DEEP`` where a bounded schema's stand-in is read (fastavro's documented hook for
    custom logical types: a process-wide table, so called by the service at start, not at import)."""
    LOGICAL_READERS[f"fixed-{_NESTING_LIMIT}"] = _too_deep


def bounded_avro_schema(parsed: Any, limit: int = MAX_JSON_DEPTH) -> Any:
    """``parsed`` (a schema as fastavro parses it) if no value of it nests deeper than ``limit``; else the same
    layout unrolled to ``limit`` levels, parsed, whose reading raises ``TOO_DEEP`` past them. ``RequestError`` when
    an array's items take no bytes, so that its length is not bounded by the value's."""
    named = parsed.get("__named_schemas", {}) if isinstance(parsed, dict) else {}
    walk = _AvroWalk(named, limit)
    if walk.depth(parsed, frozenset()) <= limit:
        return parsed
    return parse_schema(walk.unrolled(parsed, 1))


class _AvroWalk:
    """One walk of a parsed Avro schema: ``named`` maps each full name to its definition (fastavro's
    ``__named_schemas``), where a later use of the name is the name alone."""

    def __init__(self, named: dict[str, Any], limit: int) -> None:
        self.named = named
        self.limit = limit
        self.emitted: set[str] = set()
        self.depths: dict[str, float] = {}
        """The depth of each named type: the same wherever it is used (when it reaches a type that uses it, both
        recurse), so that a schema whose types each use the one before twice is walked once per type."""

    def depth(self, schema: Any, names: frozenset[str]) -> float:
        """The deepest nesting of records, arrays and maps a value of ``schema`` can have; infinite when it
        recurses. Refuses an array whose items take no bytes."""
        if isinstance(schema, list):
            return max((self.depth(branch, names) for branch in schema), default=0)
        if isinstance(schema, str):
            if schema not in self.named:
                return 0
            if schema in names:
                return math.inf
            if schema not in self.depths:
                self.depths[schema] = self.depth(self.named[schema], names | {schema})
            return self.depths[schema]
        kind = schema.get("type")
        if kind in ("record", "error"):
            inner = frozenset(names | {schema["name"]})
            return 1 + max((self.depth(field["type"], inner) for field in schema["fields"]), default=0)
        if kind == "array":
            if self.empty(schema["items"], frozenset()):
                raise RequestError(f"the request's Avro schema has an array of items that take no bytes "
                                   f"({_type_name(schema['items'])}): its length is not bounded by the value's",
                                   ErrorCode.BAD_REQUEST)
            return 1 + self.depth(schema["items"], names)
        if kind == "map":
            return 1 + self.depth(schema["values"], names)
        return 0

    def empty(self, schema: Any, names: frozenset[str]) -> bool:
        """Whether a value of ``schema`` can be written in no bytes."""
        if isinstance(schema, str):
            if schema == "null":
                return True
            return schema in self.named and schema not in names and self.empty(self.named[schema], names | {schema})
        if isinstance(schema, list):
            return False  # a union writes its branch's index
        kind = schema.get("type")
        if kind in ("record", "error"):
            inner = frozenset(names | {schema["name"]})
            return all(self.empty(field["type"], inner) for field in schema["fields"])
        if kind == "fixed":
            return bool(schema["size"] == 0)
        return bool(kind == "null")

    def unrolled(self, schema: Any, depth: int) -> Any:
        """``schema`` for a value at nesting ``depth``, as schema JSON: each record a copy per depth (named for it,
        its fields' names and types only: the deserializer reads with the writer's schema alone, so defaults and
        aliases have no use), and what would nest past the limit the stand-in. Each name is defined where it is first
        written, in the order fastavro reads the schema, and named alone after that."""
        if isinstance(schema, list):
            return [self.unrolled(branch, depth) for branch in schema]
        if isinstance(schema, str):
            return self.unrolled(self.named[schema], depth) if schema in self.named else schema
        kind = schema.get("type")
        if kind in _CONTAINERS and depth > self.limit:
            return self._define(f"kinference.too_deep.{_type_name(schema).replace('.', '_')}",
                                lambda name: {"type": "fixed", "name": name, "size": 0, "logicalType": _NESTING_LIMIT})
        if kind in ("record", "error"):
            return self._define(f"{schema['name']}_at_{depth}", lambda name: {
                "type": kind, "name": name,
                "fields": [{"name": field["name"], "type": self.unrolled(field["type"], depth + 1)}
                           for field in schema["fields"]]})
        if kind == "array":
            return {"type": "array", "items": self.unrolled(schema["items"], depth + 1)}
        if kind == "map":
            return {"type": "map", "values": self.unrolled(schema["values"], depth + 1)}
        if kind in ("enum", "fixed"):
            return self._define(schema["name"], lambda _name: {key: value for key, value in schema.items()
                                                               if not key.startswith("__")})
        return schema

    def _define(self, name: str, definition: Callable[[str], dict[str, Any]]) -> Any:
        if name in self.emitted:
            return name
        self.emitted.add(name)
        return definition(name)


_ALIGN = 16
"""Python's small-object allocator hands out blocks in multiples of 16 bytes."""
_SLOT = 16
"""A list's slot per item, with the spare slots ``list.append`` keeps: up to twice the items in a short list (five
items in eight slots), an eighth more in a long one."""
_LIST = 56
"""An empty list, paid by the count that ends the array (its first four slots by the count before the items)."""
_MAP_ENTRY = 60
"""A dict's share per key: its first table (120 bytes, up to five keys) paid by the first key and count (two bytes
or more), then ~35 bytes a key as the table doubles."""
_MAP = 64
"""An empty dict, paid by the count that ends the map."""
_PER_BYTE = {"boolean": 0, "int": 32, "long": 32, "float": 8, "double": 4, "string": 28, "bytes": 24, "enum": 0}
"""Bytes held per byte read, at most, for each scalar type (each takes a byte or more): an int of one varint byte is
a 32-byte object (small ones are shared); a string of 2 bytes and its length a 76-byte object (a UCS-2 character:
26x); bytes of 1 byte 48 (24x); an enum's symbol the schema's own string. A float 32 in 4, a double in 8."""
_LOGICAL = 128
"""A logical type's object (a Decimal, datetime, UUID) beside its underlying value, per byte (it takes one or more)."""
_TOP = 256
"""Beside what the value's bytes pay for: the top-level value's own object."""


def _aligned(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


class AvroHeld:
    """At most what a value of an Avro schema (parsed, and bounded: no recursion) holds decoded: ``per_byte`` times
    its bytes, plus ``fixed``. Read from the schema once, so that a record is charged (or refused) before it is
    decoded.

    Each object of the decoded value is paid for by bytes of the value that no other object uses: a scalar, an
    array, a map or a union by its own bytes (the varints of its value, counts, length or branch index: one or
    more); a record (which has no bytes of its own: its fields' bytes are its value) by the bytes of the scalars,
    arrays, maps and unions among its fields, nested records followed; a record made of nulls alone by its parent
    (a union's index, a map's key; an array of such records is refused by ``bounded_avro_schema``). ``per_byte`` is
    the most any byte pays for. The top-level record and the records in it are one each: counted once, in
    ``fixed``."""

    def __init__(self, parsed: Any) -> None:
        named = parsed.get("__named_schemas", {}) if isinstance(parsed, dict) else {}
        self._named: dict[str, Any] = named
        self._clusters: dict[int, tuple[int, int]] = {}
        self._visited: set[tuple[int, float]] = set()
        self.per_byte = 0.0
        self.fixed = _TOP
        if self._pays(parsed):
            self._visit(parsed, 0.0)
        else:  # the top record and the records in it, once: a constant, not spread over its bytes
            self.fixed += self._cluster(parsed)[0]
            self._members(parsed, 0.0)

    def of(self, size: int) -> int:
        """At most what a value of ``size`` bytes holds decoded, its bytes included."""
        return int(size * (1 + self.per_byte)) + self.fixed

    def _resolve(self, schema: Any) -> Any:
        return self._named.get(schema, schema) if isinstance(schema, str) else schema

    def _pays(self, schema: Any) -> bool:
        """Whether a value of ``schema`` has bytes of its own (is not a record, a null or a fixed of no bytes)."""
        schema = self._resolve(schema)
        if isinstance(schema, list):
            return True
        kind = schema if isinstance(schema, str) else schema.get("type")
        if kind == "fixed":
            return bool(schema["size"] > 0)
        return kind not in ("record", "error", "null")

    def _cluster(self, schema: Any) -> tuple[int, int]:
        """A record (or null) and the records among its fields, nested: what they hold, and how many values with bytes
        of their own they contain (which pay for them)."""
        schema = self._resolve(schema)
        if not isinstance(schema, dict) or schema.get("type") not in ("record", "error"):
            return 0, 0
        known = self._clusters.get(id(schema))
        if known is None:
            cost, payers = _record_bytes(len(schema["fields"])), 0
            for field in schema["fields"]:
                inner = (0, 1) if self._pays(field["type"]) else self._cluster(field["type"])
                cost, payers = cost + inner[0], payers + inner[1]
            known = self._clusters[id(schema)] = (cost, payers)
        return known

    def _visit(self, schema: Any, share: float) -> None:
        """Every value of ``schema`` with bytes of its own pays ``share`` per byte beside its own objects: what the
        records around it (or its list slot) hold, split among the values that pay for them."""
        schema = self._resolve(schema)
        if (id(schema), share) in self._visited:
            return
        self._visited.add((id(schema), share))
        if not self._pays(schema):
            cost, payers = self._cluster(schema)
            if payers:
                self._members(schema, (cost + share) / payers)
            return
        self.per_byte = max(self.per_byte, self._own(schema) + share)
        if isinstance(schema, list):
            for branch in schema:
                self._visit(branch, 0.0)
        elif isinstance(schema, dict) and schema.get("type") == "array":
            self._visit(schema["items"], _SLOT)
        elif isinstance(schema, dict) and schema.get("type") == "map":
            self._visit(schema["values"], 0.0)

    def _members(self, schema: Any, share: float) -> None:
        """``_visit`` each field with bytes of its own in a record and its nested records."""
        schema = self._resolve(schema)
        if not isinstance(schema, dict) or schema.get("type") not in ("record", "error"):
            return
        for field in schema["fields"]:
            if self._pays(field["type"]):
                self._visit(field["type"], share)
            else:
                self._members(field["type"], share)

    def _unpaid(self, schema: Any) -> int:
        """What a value of ``schema`` holds that its own fields cannot pay for (a record of nulls): 0 otherwise."""
        if self._pays(schema):
            return 0
        cost, payers = self._cluster(schema)
        return cost if payers == 0 else 0

    def _own(self, schema: Any) -> float:
        """The most a value of ``schema`` (one with bytes of its own) holds per byte of its own."""
        if isinstance(schema, list):  # the branch index pays for a branch that cannot pay for itself
            return float(max((self._unpaid(branch) for branch in schema), default=0))
        if isinstance(schema, str):
            return _PER_BYTE.get(schema, 0)
        kind = schema.get("type")
        logical = _LOGICAL if "logicalType" in schema else 0
        if kind == "array":
            return _LIST  # paid by the count that ends it
        if kind == "map":  # each key: its string, its entry and a value of nulls
            return max(_MAP, _PER_BYTE["string"] + _MAP_ENTRY + self._unpaid(schema["values"]))
        if kind == "fixed":
            size = int(schema["size"])
            return logical + _aligned(sys.getsizeof(b"") + size) / size
        return logical + _PER_BYTE.get(kind, 0)


def _record_bytes(fields: int) -> int:
    """A record's dict of ``fields`` keys, filled a key at a time as fastavro fills it."""
    record: dict[str, None] = {}
    for index in range(fields):
        record[str(index)] = None
    return _aligned(sys.getsizeof(record))


def _type_name(schema: Any) -> str:
    if isinstance(schema, str):
        return schema
    return str(schema.get("name", schema.get("type")))


# --- Protobuf

PROTOBUF_PER_BYTE = 100
"""The most a Protobuf value holds as ``message_to_dict``'s dict, per byte (measured): a chain of nested messages, each
level two bytes and a one-key dict, 92; packed int64s, each a string, 58; repeated one-boolean messages 48."""
_WRAPPERS = "google/protobuf/wrappers.proto"
_AS_STRING = frozenset(("google.protobuf.Timestamp", "google.protobuf.Duration", "google.protobuf.FieldMask"))
_WELL_KNOWN = _AS_STRING | {f"google.protobuf.{name}" for name in ("Any", "Struct", "Value", "ListValue")}
"""The messages whose JSON is not an object of their fields: inside an ``Any`` they go as its ``value``."""
_INT64 = frozenset((FieldDescriptor.CPPTYPE_INT64, FieldDescriptor.CPPTYPE_UINT64))
_FLOATS = frozenset((FieldDescriptor.CPPTYPE_FLOAT, FieldDescriptor.CPPTYPE_DOUBLE))
_NON_FINITE = {math.inf: "Infinity", -math.inf: "-Infinity"}
_EXACT_POWERS = 22
"""10**22 is the largest power of ten a double holds exactly: a float rounded with a larger scale goes the slow way."""


def message_to_dict(message: Message, limit: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    """``json_format.MessageToDict(message, preserving_proto_field_name=True)``, a repeated scalar field at a time in
    C; ``RequestError`` (``TOO_DEEP``) when the dict would nest deeper than ``limit`` levels. The one difference: a
    ``float`` whose shortest decimal form is found in C may differ from ``json_format``'s in its last digit, both
    the same float once narrowed (subnormals, ties)."""
    converted = _ProtoJson(limit).message(message, 1)
    if not isinstance(converted, dict):
        raise RequestError(f"the request is a {message.DESCRIPTOR.full_name}; expected a record",
                           ErrorCode.BAD_REQUEST)
    return converted


class _ProtoJson:
    """One message's conversion, each container counted against ``limit`` as it is made."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def level(self, level: int) -> int:
        if level > self.limit:
            raise RequestError(TOO_DEEP, ErrorCode.BAD_REQUEST)
        return level

    def message(self, message: Message, level: int) -> Any:
        """The JSON of ``message``, an object (when it is one) at nesting ``level``."""
        descriptor = message.DESCRIPTOR
        name = descriptor.full_name
        if descriptor.file.name == _WRAPPERS:
            return self.scalar(descriptor.fields_by_name["value"], message.value)
        if name in _AS_STRING:
            return message.ToJsonString()
        if name == "google.protobuf.Value":
            return self.value(message, level)
        self.level(level)
        if name == "google.protobuf.ListValue":
            return [self.value(item, level + 1) for item in message.values]
        if name == "google.protobuf.Struct":
            fields = message.fields
            return {key: self.value(fields[key], level + 1) for key in fields}
        if name == "google.protobuf.Any":
            return self.any(message, level)
        return self.fields(message, level)

    def fields(self, message: Message, level: int) -> dict[str, Any]:
        converted: dict[str, Any] = {}
        for field, value in message.ListFields():
            name = f"[{field.full_name}]" if field.is_extension else field.name
            if field.message_type is not None and field.message_type.GetOptions().map_entry:
                value_field = field.message_type.fields_by_name["value"]
                keys = list(value)
                values = self.repeated(value_field, [value[key] for key in keys], self.level(level + 1))
                converted[name] = dict(zip(map(_map_key, keys), values, strict=True))
            elif is_repeated(field):
                converted[name] = self.repeated(field, value, self.level(level + 1))
            else:
                converted[name] = self.item(field, value, level)
        return converted

    def item(self, field: FieldDescriptor, value: Any, level: int) -> Any:
        """A value of ``field`` in a container at ``level``."""
        if field.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
            return self.message(value, level + 1)
        return self.scalar(field, value)

    def repeated(self, field: FieldDescriptor, values: Any, level: int) -> list[Any]:
        """The values of a repeated field (or a map's values), in a container at ``level``: one C call per field for
        the scalar types."""
        kind = field.cpp_type
        if kind == FieldDescriptor.CPPTYPE_MESSAGE:
            inner = field.message_type
            if inner.full_name in _WELL_KNOWN or inner.file.name == _WRAPPERS:
                return [self.message(value, level + 1) for value in values]
            fields = self.fields  # a plain message: its fields, without looking at its type for each
            self.level(level + 1)
            return [fields(value, level + 1) for value in values]
        if kind in _INT64:
            return list(map(str, values))
        if kind == FieldDescriptor.CPPTYPE_STRING and field.type == FieldDescriptor.TYPE_BYTES:
            return [base64.b64encode(value).decode() for value in values]
        if kind == FieldDescriptor.CPPTYPE_ENUM:
            return [self.scalar(field, value) for value in values]
        if kind in _FLOATS:
            return _floats(values, kind == FieldDescriptor.CPPTYPE_FLOAT)
        return list(values)  # int32, uint32, bool, string: as they are

    def scalar(self, field: FieldDescriptor, value: Any) -> Any:
        kind = field.cpp_type
        if kind == FieldDescriptor.CPPTYPE_ENUM:
            enum = field.enum_type
            if enum.full_name == "google.protobuf.NullValue":
                return None
            named = enum.values_by_number.get(value)
            return value if named is None else named.name
        if kind == FieldDescriptor.CPPTYPE_STRING and field.type == FieldDescriptor.TYPE_BYTES:
            return base64.b64encode(value).decode()
        if kind in _INT64:
            return str(value)
        if kind in _FLOATS:
            if not math.isfinite(value):
                return _NON_FINITE.get(value, "NaN")
            return type_checkers.ToShortestFloat(value) if kind == FieldDescriptor.CPPTYPE_FLOAT else value
        return value

    def value(self, value: Message, level: int) -> Any:
        """A ``google.protobuf.Value`` at ``level``: JSON itself."""
        kind = value.WhichOneof("kind")
        if kind is None or kind == "null_value":
            return None
        if kind == "number_value" and not math.isfinite(value.number_value):
            raise ValueError(f"Value.number_value is {value.number_value}, which JSON cannot hold")
        if kind in ("struct_value", "list_value"):
            return self.message(getattr(value, kind), level)
        return getattr(value, kind)

    def any(self, message: Message, level: int) -> dict[str, Any]:
        """An ``Any``: its message (from the default pool, as ``json_format`` finds it), with ``@type``."""
        if not message.ListFields():
            return {}
        url = message.type_url
        descriptor: Descriptor = descriptor_pool.Default().FindMessageTypeByName(url.split("/")[-1])
        inner = message_factory.GetMessageClass(descriptor)()
        inner.ParseFromString(message.value)
        converted = self.message(inner, level)
        if descriptor.full_name in _WELL_KNOWN or descriptor.file.name == _WRAPPERS:
            return {"@type": url, "value": converted}
        return {"@type": url, **converted}


def _map_key(key: Any) -> str:
    if isinstance(key, bool):
        return "true" if key else "false"
    return str(key)


def _floats(values: Any, narrow: bool) -> list[Any]:
    """Doubles as they are and floats as the shortest decimal (of at least 6 digits) that narrows back to them, as
    ``json_format`` writes them; infinities and NaN as its strings."""
    wide = np.fromiter(values, dtype=np.float64)
    finite = np.isfinite(wide)
    if narrow:
        wide = _shortest(wide, finite)
    converted: list[Any] = wide.tolist()
    if not finite.all():
        for index in np.flatnonzero(~finite).tolist():
            converted[index] = _NON_FINITE.get(converted[index], "NaN")
    return converted


def _shortest(wide: np.ndarray, finite: np.ndarray) -> np.ndarray:
    """``type_checkers.ToShortestFloat`` of each float (widened), in C: rounded to 6, 7, 8 then 9 significant
    digits, the first that narrows back to the float."""
    narrow = wide.astype(np.float32)
    result = wide.copy()
    magnitude = np.abs(wide, where=finite, out=np.ones_like(wide))
    magnitude[magnitude == 0] = 1
    exponent = np.floor(np.log10(magnitude))
    pending = finite & (wide != 0)
    slow = np.zeros_like(pending)
    for digits in range(6, 10):
        shift = digits - 1 - exponent
        exact = np.abs(shift) <= _EXACT_POWERS
        scale = 10.0 ** np.abs(np.where(exact, shift, 0))
        up = shift >= 0
        rounded = np.where(up, np.round(wide * np.where(up, scale, 1)) / np.where(up, scale, 1),
                           np.round(wide / np.where(up, 1, scale)) * np.where(up, 1, scale))
        done = pending & exact & (rounded.astype(np.float32) == narrow)
        result[done] = rounded[done]
        slow |= pending & ~exact  # past the exact powers of ten: Python's own formatting
        pending &= exact & ~done
    if slow.any():
        for index in np.flatnonzero(slow).tolist():
            result[index] = type_checkers.ToShortestFloat(float(narrow[index]))
    return result


def is_repeated(field: FieldDescriptor) -> bool:
    """Whether ``field`` is repeated: protobuf 7 has only ``is_repeated``, releases before 6.30 (the lowest that
    confluent-kafka's serializers allow) only ``label``."""
    repeated = getattr(field, "is_repeated", None)
    if repeated is not None:
        return bool(repeated)
    return bool(field.label == FieldDescriptor.LABEL_REPEATED)
