"""Property-based fuzzing of everything a hostile record meets in the poll thread (issue 20): the request decoder
(kinference's JSON with its Spring and routing headers, Open Inference Protocol requests, Schema Registry framing)
and the image handler's ``validate``.

Whatever the input, no ``internal_error``: a malformed request is ``bad_request``, ``payload_too_large`` or
``model_not_found``, and the image validator raises nothing but ``InvalidInput``. Work is bounded by construction
(asserted here where the code can be watched: the products over OIP shapes; the rest is in the unit tests of each
bound), never by wall-clock time. The slowest decode seen is printed in the terminal summary, to watch the trend.
"""

from __future__ import annotations

import base64
import io
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from kinference import protocol
from kinference.consumer.path.request import RequestDecoder
from kinference.consumer.path.router import ModelRoute, Router
from kinference.consumer.wire import oip
from kinference.consumer.wire.serdes import SchemaRegistryFormat
from kinference.errors import InvalidInput
from kinference.handlers.image import ImageClassificationHandler
from kinference.protocol import ErrorCode
from tests.fakes import FakeRecord
from tests.schemas import Producer
from tests.unit.consumer.path.test_request_fuzz import headers as spring_and_kinference_headers
from tests.unit.consumer.path.test_request_fuzz import json_values, mutated_json, values

MAX_REQUEST_BYTES = 65_536
CLIENT_CODES = {ErrorCode.BAD_REQUEST, ErrorCode.PAYLOAD_TOO_LARGE, ErrorCode.MODEL_NOT_FOUND}
FUZZ = settings(max_examples=400, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
SLOWEST: dict[str, tuple[float, str]] = {}
"""Per fuzzed decoder: (seconds, what it was given) of its slowest call."""


def timed(name: str, call: Callable[[], Any], given: bytes | None) -> Any:
    started = time.perf_counter()
    try:
        return call()
    finally:
        elapsed = time.perf_counter() - started
        if elapsed > SLOWEST.get(name, (0.0, ""))[0]:
            SLOWEST[name] = (elapsed, f"{len(given or b'')} bytes: {(given or b'')[:60]!r}")


def slowest_lines() -> list[str]:
    """The terminal summary's lines (tests/conftest.py's ``pytest_terminal_summary``)."""
    return [f"fuzz: slowest {name}: {seconds * 1000:.2f} ms ({example})"
            for name, (seconds, example) in sorted(SLOWEST.items())]


def assert_no_internal_error(request: Any) -> None:
    if request.error is not None:
        assert request.error.code in CLIENT_CODES, (request.error.code, request.error.message)
        assert request.error.message


# --- kinference's JSON, Spring's and the routing headers

ROUTED = Router([ModelRoute("e1", "1", "json", oip.ServedModel("e1", "1")), ModelRoute("e2", None, "bytes")])
routing_headers = st.lists(st.tuples(st.sampled_from([protocol.MODEL, protocol.MODEL_VERSION, oip.MODEL_HEADER,
                                                      oip.VERSION_HEADER]),
                                     st.sampled_from([b"e1", b"e2", b"1", b"2", b"\xff", b"", None])), max_size=4)


@FUZZ
@given(value=values, record_headers=st.builds(lambda a, b: a + b, spring_and_kinference_headers, routing_headers))
def test_json_and_headers_never_give_an_internal_error(value, record_headers):
    decoder = RequestDecoder("replies", MAX_REQUEST_BYTES, router=ROUTED)
    assert_no_internal_error(timed("JSON decode", lambda: decoder.decode(FakeRecord(value, record_headers)), value))


def test_a_deep_document_is_refused_at_decode():
    decoder = RequestDecoder("replies", MAX_REQUEST_BYTES)
    for deep in (b"[" * 400 + b"]" * 400, b'{"a":' * 300 + b"1" + b"}" * 300):
        request = timed("JSON decode", lambda deep=deep: decoder.decode(FakeRecord(deep)), deep)
        assert request.error.code == ErrorCode.BAD_REQUEST


# --- Open Inference Protocol requests

sizes = st.one_of(st.integers(0, 4), st.sampled_from([2**31, 2**63 - 1, 2**64 - 1, -1]), st.booleans(),
                  st.text(max_size=2))
tensor_data = st.recursive(st.one_of(st.integers(-(2**63), 2**64 - 1), st.floats(), st.booleans(), st.text(max_size=4),
                                     st.none()),
                           lambda children: st.lists(children, max_size=4), max_leaves=16)


@st.composite
def oip_values(draw: st.DrawFn) -> bytes:
    """OIP InferenceRequests, mostly well-formed in shape, with hostile shapes, data, datatypes and parameters."""
    def tensor() -> Any:
        shape = draw(st.one_of(st.lists(sizes, max_size=10), st.just([1] + [2**64 - 1] * 2000), json_values))
        item = {"name": draw(st.one_of(st.text(max_size=5), json_values)), "shape": shape,
                "datatype": draw(st.sampled_from(sorted(oip.DATATYPES)) | json_values), "data": draw(tensor_data)}
        if draw(st.booleans()):
            item["parameters"] = draw(st.one_of(st.just({"content_type": "base64"}), json_values))
        return item if draw(st.integers(0, 9)) else draw(json_values)

    body = {"inputs": [tensor() for _ in range(draw(st.integers(0, 3)))]}
    for key in ("id", "parameters", "outputs"):
        if draw(st.booleans()):
            body[key] = draw(json_values)
    raw = orjson.dumps(body)
    return draw(st.one_of(st.just(raw), mutated_json()))


@FUZZ
@given(value=oip_values(), payload_format=st.sampled_from(["json", "bytes"]), key=st.none() | st.binary(max_size=8),
       record_headers=routing_headers)
def test_oip_requests_never_give_an_internal_error_and_shapes_stay_bounded(value, payload_format, key,
                                                                           record_headers, monkeypatch):
    def bounded_prod(shape: list[int]) -> int:
        assert len(shape) <= oip.MAX_DIMENSIONS and max(shape) <= len(value), shape[:10]
        return int(np.prod(shape, dtype=object))

    monkeypatch.setattr(oip.math, "prod", bounded_prod)
    decoder = RequestDecoder("replies", MAX_REQUEST_BYTES, payload_format=payload_format,
                             model=oip.ServedModel("e1", "1", "oip"))
    record = FakeRecord(value, [(oip.MODEL_HEADER, b"e1"), *record_headers], key=key)
    assert_no_internal_error(timed("OIP decode", lambda: decoder.decode(record), value))


# --- Schema Registry framing (confluent-kafka's in-memory registry: a schema it lacks is its 404)

@pytest.fixture(scope="module")
def registered() -> dict[str, tuple[SchemaRegistryFormat, bytes]]:
    """Per format: the decoding side, and one valid request value to mutate."""
    formats = {}
    for value_format in ("avro", "protobuf", "jsonschema"):
        client = SchemaRegistryClient.new_client({"url": f"mock://{uuid.uuid4().hex}"})
        formats[value_format] = (SchemaRegistryFormat(value_format, client),
                                 Producer(value_format, client).request("requests", "hello"))
    return formats


@st.composite
def framed(draw: st.DrawFn, valid: bytes) -> bytes:
    """A valid framed value, its framing (magic byte, schema id, Protobuf indexes) or body mutated, or garbage."""
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return draw(st.binary(max_size=40))
    data = bytearray(valid)
    if kind == 1:  # the 5-byte prefix: magic byte and schema id
        data[: draw(st.integers(1, 5))] = draw(st.binary(min_size=1, max_size=5))
    elif kind == 2:
        data = data[: draw(st.integers(0, len(data)))] + draw(st.binary(max_size=8))
    else:
        at = draw(st.integers(0, len(data) - 1))
        data[at] = draw(st.integers(0, 255))
    return bytes(data)


@FUZZ
@given(data=st.data(), value_format=st.sampled_from(["avro", "protobuf", "jsonschema"]))
def test_schema_registry_framing_never_gives_an_internal_error(registered, data, value_format):
    schemas, valid = registered[value_format]
    value = data.draw(framed(valid))
    decoder = RequestDecoder("replies", MAX_REQUEST_BYTES, schemas=schemas)
    assert_no_internal_error(timed(f"{value_format} decode", lambda: decoder.decode(FakeRecord(value)), value))


# --- the image validator

def image_bytes(image_format: str, **save: Any) -> bytes:
    out = io.BytesIO()
    Image.frombytes("RGB", (16, 16), bytes(range(256)) * 3).save(out, image_format, **save)
    return out.getvalue()


SEEDS = [image_bytes("JPEG"), image_bytes("JPEG", progressive=True), image_bytes("PNG"), image_bytes("WEBP"),
         image_bytes("GIF")]


@st.composite
def images(draw: st.DrawFn) -> bytes:
    """Real images of each format with bytes replaced, inserted, repeated or cut off, and JSON-wrapped ones."""
    data = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(0, 4))):
        at = draw(st.integers(0, len(data)))
        action = draw(st.sampled_from(["replace", "insert", "truncate", "repeat"]))
        if action == "truncate":
            del data[at:]
        elif action == "repeat":
            data[at:at] = data[at: at + draw(st.integers(1, 64))] * draw(st.integers(1, 100))
        elif action == "insert" or at == len(data):
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        else:
            data[at] = draw(st.integers(0, 255))
    return draw(st.sampled_from([bytes(data), b'{"image": "' + base64.b64encode(data) + b'"}']))


@FUZZ
@given(payload=images())
def test_the_image_validator_raises_nothing_but_invalid_input(payload):
    validator = ImageClassificationHandler()
    for key, value in ImageClassificationHandler.defaults.items():
        setattr(validator, key, value)
    try:
        item = timed("image validate", lambda: validator.validate(payload), payload)
    except InvalidInput as refused:
        assert str(refused)
        return
    assert item.format in ("JPEG", "PNG", "WEBP")
    assert item.size[0] * item.size[1] <= validator.max_pixels
    assert item.format != "JPEG" or item.data.count(b"\xff\xda") <= validator.max_scans
