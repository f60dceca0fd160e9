"""Property-based fuzzing of the wire protocol: arbitrary record values and header lists.

Whatever a record holds, ``RequestDecoder.decode`` returns a ``Request`` (it never raises); a record
it cannot read carries a known error code and is marked for the dead-letter topic; the reply and the
dead letter built from any request encode, and a real confluent-kafka producer accepts them.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

import orjson
import pytest
from confluent_kafka import Producer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kinference import protocol
from kinference.consumer.delivery import answers
from kinference.consumer.path import request as requests
from kinference.errors import RequestError
from kinference.protocol import ErrorCode
from tests.fakes import FakeRecord

KNOWN_HEADERS = [protocol.CORRELATION_ID, protocol.REPLY_TO, protocol.DEADLINE_MS, protocol.SPRING_CORRELATION_ID,
                 protocol.SPRING_REPLY_TOPIC, protocol.SPRING_REPLY_PARTITION]
DECODE_CODES = {ErrorCode.BAD_REQUEST, ErrorCode.PAYLOAD_TOO_LARGE}
FUZZ = settings(max_examples=2000, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


@st.composite
def mutated_json(draw: st.DrawFn) -> bytes:
    """A valid JSON document with a few bytes replaced, inserted or cut off."""
    data = bytearray(orjson.dumps(draw(json_values)))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(data)))
        action = draw(st.sampled_from(["replace", "insert", "truncate"]))
        if action == "truncate":
            del data[at:]
        elif action == "insert" or at == len(data):
            data[at:at] = draw(st.binary(min_size=1, max_size=3))
        else:
            data[at] = draw(st.integers(0, 255))
    return bytes(data)


values = st.one_of(
    st.none(),
    st.binary(max_size=200),
    st.builds(orjson.dumps, json_values),
    mutated_json(),
    st.text(max_size=50).map(str.encode),
    st.sampled_from([b"", b"NaN", b"1e400", b'"\\ud800"', b"\xef\xbb\xbf{}", b"[" * 300 + b"]" * 300,
                     b"[" * 2000 + b"]" * 2000, b"18446744073709551616", b"\x00", b'{"a":1,"a":2}']),
)

header_values = st.one_of(
    st.none(),
    st.binary(max_size=40),
    st.text(max_size=300).map(str.encode),  # correlation ids, 0-300 characters
    st.from_regex(r"[A-Za-z0-9._-]{1,20}", fullmatch=True).map(str.encode),  # legal topics
    st.integers(-(2**31), 2**31 - 1).map(lambda n: struct.pack(">i", n)),  # reply partitions
    st.integers(-(2**70), 2**70).map(lambda n: str(n).encode()),  # deadlines
    st.sampled_from([b" 12 ", b"+5", b"1_000", "١٢".encode(), b"..", b".", b"a" * 250, b"\xff"]),
)
header_names = st.sampled_from(KNOWN_HEADERS) | st.text(max_size=20)
headers = st.lists(st.tuples(header_names, header_values), max_size=6)

decoders = st.builds(
    requests.RequestDecoder,
    default_reply_topic=st.just("replies"),
    max_request_bytes=st.sampled_from([1, 64, 1_048_576]),
    payload_format=st.sampled_from(["json", "bytes", "record"]),
    max_header_bytes=st.sampled_from([1, 64, 16_384]),
    max_key_bytes=st.sampled_from([4, 4096]),
)


@pytest.fixture(scope="module")
def producer() -> Iterator[Producer]:
    """A producer that never reaches a broker: ``produce()`` still checks and queues each record."""
    client = Producer({"bootstrap.servers": "127.0.0.1:9", "log_level": 0, "message.timeout.ms": 1000})
    yield client
    client.purge()
    client.flush(0)


@FUZZ
@given(decoder=decoders, value=values, record_headers=st.none() | headers, key=st.none() | st.binary(max_size=8))
def test_decode_never_raises_and_every_outcome_encodes(producer, decoder, value, record_headers, key):
    record = FakeRecord(value, headers=record_headers, key=key, topic="requests", partition=3, offset=41)
    request = decoder.decode(record, received=10.0)

    fits = key is None or len(key) <= decoder.max_key_bytes
    assert (request.topic, request.partition, request.offset, request.key) == ("requests", 3, 41, key if fits else None)
    assert request.key_omitted == (None if fits else len(key))
    assert request.value == value and request.headers == (record_headers or [])
    if request.error is not None:
        assert request.dead_letter and request.error.code in DECODE_CODES and request.error.message
    else:
        assert not request.dead_letter
        assert len(value or b"") <= decoder.max_request_bytes
        assert sum(len(name) + len(raw or b"") for name, raw in request.headers) <= decoder.max_header_bytes
        if decoder.payload_format == "json":
            assert request.payload == orjson.loads(value)
        elif decoder.payload_format == "record":
            assert (request.payload.value, request.payload.key) == (value or b"", key)
            assert request.payload.correlation_id == request.correlation_id
        else:
            assert request.payload == (value or b"")
    assert isinstance(request.correlation_id, str)

    # What the stages would do with an ok request: encode its result (the echo handler's).
    if request.ok:
        try:
            request.reply_value = protocol.encode_result(request.payload)
        except TypeError as exc:  # e.g. nested deeper than orjson encodes
            request.fail(RequestError(str(exc), ErrorCode.HANDLER_ERROR))

    reply_headers = answers.reply_headers(request, now=10.5)
    reply = answers.reply_value(request)
    assert all(isinstance(name, str) and isinstance(raw, bytes) for name, raw in reply_headers)
    by_name = dict(reply_headers)
    assert by_name[protocol.STATUS] == (b"ok" if request.ok else b"error")
    assert by_name[protocol.CORRELATION_ID].decode() == request.correlation_id
    assert (protocol.ERROR_CODE in by_name) == (not request.ok)
    body = orjson.loads(reply)
    if request.ok:
        assert body == {"result": orjson.loads(orjson.dumps(request.payload))}
    else:
        assert body["error"]["code"] in set(ErrorCode)
        assert by_name[protocol.ERROR_CODE] == body["error"]["code"].encode()
    producer.produce("replies", reply, key, headers=reply_headers)

    if request.dead_letter:
        letter_headers = answers.dead_letter_headers(request, request.error)
        assert letter_headers[: len(request.headers)] == request.headers
        added = dict(letter_headers[len(request.headers):])
        assert added[protocol.ERROR_CODE] == str(request.error.code).encode()
        assert added[protocol.SOURCE_OFFSET] == b"41" and added[protocol.SOURCE_PARTITION] == b"3"
        producer.produce("dead-letters", request.value, key, headers=letter_headers)
    producer.purge(in_queue=True, in_flight=False, blocking=False)


ROUTING = (protocol.CORRELATION_ID, protocol.REPLY_TO, protocol.SPRING_REPLY_TOPIC)


@settings(FUZZ, max_examples=500)
@given(value=values, record_headers=st.lists(st.tuples(header_names.filter(lambda n: n not in ROUTING),
                                                       header_values), max_size=6))
def test_routing_headers_are_read_even_when_another_header_is_bad(value, record_headers):
    """Whatever else a record holds, its valid routing headers are read (an error reply finds its caller)."""
    good = [(protocol.CORRELATION_ID, b"caller-1"), (protocol.REPLY_TO, b"their-replies")]
    request = requests.RequestDecoder("replies", 1_048_576).decode(FakeRecord(value, headers=good + record_headers))
    assert (request.correlation_id, request.reply_topic) == ("caller-1", "their-replies")
