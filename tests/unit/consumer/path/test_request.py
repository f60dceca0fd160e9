import ctypes
import struct

import orjson
import pytest
from confluent_kafka import KafkaError, KafkaException

from kinference import protocol
from kinference.consumer.delivery import answers
from kinference.consumer.delivery.topic_metadata import ExistingTopics
from kinference.consumer.path import request as requests
from kinference.consumer.wire import jsonscan
from kinference.errors import RequestError
from kinference.protocol import ErrorCode
from tests.fakes import FakeRecord
from tests.timing import cost_ratio

DECODER = requests.RequestDecoder("replies", max_request_bytes=100)


def test_valid_request_reads_headers_and_payload():
    record = FakeRecord(b'{"text": "hi"}', headers=[
        (protocol.CORRELATION_ID, b"abc"), (protocol.REPLY_TO, b"my-replies"), (protocol.DEADLINE_MS, b"12345"),
    ], topic="t", partition=2, offset=7)
    request = DECODER.decode(record, received=1.0)
    assert request.ok and request.payload == {"text": "hi"}
    assert (request.correlation_id, request.reply_topic, request.deadline_ms) == ("abc", "my-replies", 12345)
    assert (request.topic, request.partition, request.offset, request.key) == ("t", 2, 7, b"k")


def test_missing_correlation_id_is_derived_from_position():
    request = DECODER.decode(FakeRecord(b"1", topic="t", partition=2, offset=7))
    assert request.correlation_id == "t/2/7" and request.reply_topic == "replies"


def test_spring_headers():
    spring_id = bytes(range(16))
    request = DECODER.decode(FakeRecord(b"1", headers=[
        (protocol.SPRING_CORRELATION_ID, spring_id), (protocol.SPRING_REPLY_TOPIC, b"spring-replies"),
        (protocol.SPRING_REPLY_PARTITION, struct.pack(">i", 3)),
    ]))
    assert request.ok and request.reply_topic == "spring-replies" and request.reply_partition == 3
    assert request.correlation_id == spring_id.hex()
    headers = dict(answers.reply_headers(request, now=0.0))
    assert headers[protocol.SPRING_CORRELATION_ID] == spring_id


@pytest.mark.parametrize(
    ("value", "headers", "code"),
    [
        (b"{not json", None, ErrorCode.BAD_REQUEST),
        (b"\xff\xfe", None, ErrorCode.BAD_REQUEST),
        (b"", None, ErrorCode.BAD_REQUEST),
        (None, None, ErrorCode.BAD_REQUEST),
        (b"1" * 101, None, ErrorCode.PAYLOAD_TOO_LARGE),
        (b"1", [(protocol.DEADLINE_MS, b"soon")], ErrorCode.BAD_REQUEST),
        (b"1", [(protocol.CORRELATION_ID, b"\xff")], ErrorCode.BAD_REQUEST),
        (b"1", [(protocol.REPLY_TO, b"bad topic!")], ErrorCode.BAD_REQUEST),
        (b"1", [(protocol.SPRING_REPLY_PARTITION, b"\x01")], ErrorCode.BAD_REQUEST),
    ],
)
def test_unreadable_records_become_dead_letters_with_a_code(value, headers, code):
    request = DECODER.decode(FakeRecord(value, headers=headers))
    assert not request.ok and request.dead_letter and request.error.code == code


def test_bad_header_still_keeps_the_routing_of_good_ones():
    request = DECODER.decode(FakeRecord(b"1", headers=[
        (protocol.CORRELATION_ID, b"keep-me"), (protocol.REPLY_TO, b"mine"), (protocol.DEADLINE_MS, b"x"),
    ]))
    assert request.error.code == ErrorCode.BAD_REQUEST
    assert (request.correlation_id, request.reply_topic) == ("keep-me", "mine")


def test_bytes_handlers_get_raw_values():
    decoder = requests.RequestDecoder("replies", 100, payload_format="bytes")
    assert decoder.decode(FakeRecord(b"\xff\x00")).payload == b"\xff\x00"


def test_record_handlers_get_the_value_key_and_headers_with_the_last_repeated_header_winning():
    decoder = requests.RequestDecoder("replies", 100, payload_format="record")
    record = FakeRecord(b"\xff", key=b"k", headers=[("content-type", b"text/plain"), ("x", b"1"), ("x", b"\xfe2"),
                                                    ("empty", None), (protocol.CORRELATION_ID, b"c9")])
    payload = decoder.decode(record).payload
    assert (payload.value, payload.key, payload.correlation_id) == (b"\xff", b"k", "c9")
    assert payload.headers == {"content-type": "text/plain", "x": "\ufffd2", protocol.CORRELATION_ID: "c9"}


def test_reply_encoding_and_headers():
    request = DECODER.decode(FakeRecord(b"1", headers=[(protocol.CORRELATION_ID, b"c1")]))
    request.reply_value = protocol.encode_result({"embedding": [0.5]})
    request.received, request.dispatched, request.batch_size, request.inference_ms = 1.0, 1.5, 8, 12.5
    headers = dict(answers.reply_headers(request, now=2.0))
    assert orjson.loads(answers.reply_value(request)) == {"result": {"embedding": [0.5]}}
    assert headers[protocol.STATUS] == b"ok" and headers[protocol.CORRELATION_ID] == b"c1"
    assert float(headers[protocol.QUEUE_MS]) == 500.0 and headers[protocol.BATCH_SIZE] == b"8"
    assert float(headers[protocol.SERVICE_MS]) == 1000.0 and float(headers[protocol.INFERENCE_MS]) == 12.5

    request.error = RequestError("too late", ErrorCode.DEADLINE_EXCEEDED)
    assert orjson.loads(answers.reply_value(request)) == {
        "error": {"code": "deadline_exceeded", "message": "too late"}}
    assert dict(answers.reply_headers(request, now=2.0))[protocol.ERROR_CODE] == b"deadline_exceeded"


def test_dead_letter_headers_keep_originals_and_say_where_from():
    request = DECODER.decode(FakeRecord(b"{", headers=[("x-trace", b"t1")], topic="t", partition=1, offset=9))
    headers = answers.dead_letter_headers(request, request.error)
    assert ("x-trace", b"t1") in headers
    as_dict = dict(headers)
    assert as_dict[protocol.ERROR_CODE] == b"bad_request"
    assert (as_dict[protocol.SOURCE_TOPIC], as_dict[protocol.SOURCE_PARTITION], as_dict[protocol.SOURCE_OFFSET]) == (
        b"t", b"1", b"9")


def test_oversized_headers_are_payload_too_large_but_routing_is_kept():
    decoder = requests.RequestDecoder("replies", 100, max_header_bytes=64)
    request = decoder.decode(FakeRecord(b"1", headers=[(protocol.CORRELATION_ID, b"c9"), ("junk", b"x" * 100)]))
    assert request.error.code == ErrorCode.PAYLOAD_TOO_LARGE and request.dead_letter
    assert "max_header_bytes is 64" in request.error.message and request.correlation_id == "c9"


def test_a_key_too_large_for_any_answer_is_left_out_and_the_answers_say_so():
    """Issue 29, item 2: a ~1 MB key rode on the reply and on every dead letter, none of which the broker took; the
    request was unanswerable and the service exited on every start."""
    decoder = requests.RequestDecoder("replies", 100, max_key_bytes=64)
    record = FakeRecord(b"1", headers=[(protocol.CORRELATION_ID, b"c9"), (protocol.REPLY_TO, b"mine")],
                        key=b"k" * 1_000_000, topic="t", partition=1, offset=9)
    request = decoder.decode(record)
    assert request.error.code == ErrorCode.PAYLOAD_TOO_LARGE and request.dead_letter
    assert "max_key_bytes is 64" in request.error.message
    assert (request.correlation_id, request.reply_topic) == ("c9", "mine")  # the error reply finds its caller
    reply, dead = answers.answer(request, "dead", now=1.0)
    for delivery in (reply, dead):
        _, value, key, headers, _ = delivery.record
        assert key is None and dict(headers)[protocol.KEY_OMITTED] == b"1000000"
        assert len(value) + sum(len(name) + len(raw) for name, raw in headers) < 2_000
    # A key within the bound rides on the answers, as always.
    assert decoder.decode(FakeRecord(b"1", key=b"k" * 64)).key == b"k" * 64


def test_a_dead_letter_cut_down_says_what_it_left_out():
    request = DECODER.decode(FakeRecord(b"{oops", headers=[("h", b"v")]))
    error = RequestError("bad", ErrorCode.BAD_REQUEST)
    assert dict(answers.dead_letter_headers(request, error, original=False))[protocol.ORIGINAL_OMITTED] == b"true"
    assert protocol.ORIGINAL_OMITTED not in dict(answers.dead_letter_headers(request, error))


def test_record_timestamp_is_kept_for_queue_age():
    class Timed(FakeRecord):
        def timestamp(self):
            return (1, 1_700_000_000_000)  # TIMESTAMP_CREATE_TIME

    request = DECODER.decode(Timed(b"1"), received=5.0)
    assert request.timestamp_ms == 1_700_000_000_000
    assert request.age_ms(now=5.0, now_epoch_ms=1_700_000_000_250) == 250
    assert DECODER.decode(FakeRecord(b"1"), received=5.0).age_ms(now=5.2, now_epoch_ms=0) == pytest.approx(200)


class UnreadableHeaders(FakeRecord):
    """What confluent-kafka does for a header name that is not UTF-8: headers() raises SystemError."""

    def headers(self):
        raise SystemError("<built-in method headers> returned a result with an exception set") from \
            UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")


def test_a_record_whose_headers_cannot_be_read_is_a_dead_letter_with_no_reply_route():
    request = DECODER.decode(UnreadableHeaders(b'{"text": "hi"}', key=b"k1", topic="t", partition=1, offset=9))
    assert request.dead_letter and request.unroutable and request.error.code == ErrorCode.BAD_REQUEST
    assert "headers cannot be read" in request.error.message and "UnicodeDecodeError" in request.error.message
    # The raw key and value ride along in the dead letter.
    assert (request.key, request.value, request.headers) == (b"k1", b'{"text": "hi"}', [])


def test_a_decoder_bug_is_still_a_dead_letter_not_an_exception():
    class Broken(FakeRecord):
        def timestamp(self):
            raise AttributeError("no timestamp here")

    request = DECODER.decode(Broken(b"1", topic="t", partition=0, offset=3))
    assert request.dead_letter and request.error.code == ErrorCode.INTERNAL_ERROR and request.offset == 3


ALLOWING = requests.RequestDecoder("replies", 100, reply_topic_allowed=lambda topic: topic.startswith("team-"))


def test_a_reply_topic_outside_the_allow_list_gets_an_error_on_the_default_topic():
    request = ALLOWING.decode(FakeRecord(b"1", headers=[(protocol.REPLY_TO, b"their-requests"),
                                                        (protocol.SPRING_REPLY_PARTITION, struct.pack(">i", 2))]))
    assert request.error.code == ErrorCode.REPLY_TOPIC_NOT_ALLOWED and not request.dead_letter
    assert (request.reply_topic, request.reply_partition) == ("replies", None)
    assert "their-requests" in request.error.message
    allowed = ALLOWING.decode(FakeRecord(b"1", headers=[(protocol.REPLY_TO, b"team-a")]))
    assert allowed.ok and allowed.reply_topic == "team-a"


def test_an_allowed_reply_topic_that_does_not_exist_gets_an_error_at_once_on_the_default_topic():
    """Issue 29, items 7 and 8: the reply was produced to the missing topic, which created it on a broker that
    auto-creates, or waited out librdkafka's delivery timeout (~30 s) in flight."""
    decoder = requests.RequestDecoder("replies", 100, reply_topic_allowed=lambda topic: topic.startswith("team-"),
                                      reply_topic_exists=lambda topic: topic == "team-a")
    missing = decoder.decode(FakeRecord(b"1", headers=[(protocol.REPLY_TO, b"team-b"),
                                                       (protocol.SPRING_REPLY_PARTITION, struct.pack(">i", 2))]))
    assert missing.error.code == ErrorCode.REPLY_TOPIC_NOT_FOUND and not missing.dead_letter
    assert (missing.reply_topic, missing.reply_partition) == ("replies", None) and "team-b" in missing.error.message
    assert decoder.decode(FakeRecord(b"1", headers=[(protocol.REPLY_TO, b"team-a")])).reply_topic == "team-a"
    # The default reply topic is not looked up; a topic not allowed is refused before any lookup.
    asked = []
    decoder = requests.RequestDecoder("replies", 100, reply_topic_allowed=lambda topic: topic.startswith("team-"),
                                      reply_topic_exists=lambda topic: asked.append(topic) or True)
    decoder.decode(FakeRecord(b"1", headers=[(protocol.REPLY_TO, b"replies")]))
    decoder.decode(FakeRecord(b"1", headers=[(protocol.REPLY_TO, b"elsewhere")]))
    assert asked == []


def test_existing_topics_are_listed_once_per_burst_of_misses_and_again_when_old():
    now = [0.0]
    listed = []
    topics = {"team-a"}

    def lister(timeout_s: float) -> set[str]:
        listed.append(now[0])
        return set(topics)

    existing = ExistingTopics(lister, miss_refresh_s=1.0, max_age_s=30.0, clock=lambda: now[0])
    assert existing("team-a") and listed == [0.0]
    assert not any(existing("team-b") for _ in range(1000)) and listed == [0.0]  # one burst: one listing
    topics.add("team-b")
    now[0] = 1.5
    assert existing("team-b") and listed == [0.0, 1.5]  # created since: found at the next miss
    now[0] = 40.0
    assert existing("team-a") and listed == [0.0, 1.5, 40.0]  # an old list is read again, hit or miss

    def unreachable(timeout_s: float) -> set[str]:
        raise KafkaException(KafkaError(KafkaError._TIMED_OUT))

    existing._lister = unreachable
    now[0] = 80.0
    assert existing("team-a") and not existing("team-c")  # the list read last stays in use


def test_a_bad_record_asking_for_a_forbidden_topic_is_answered_on_the_default_topic():
    """Whatever else is wrong with a record, nothing is written to a topic outside the allow-list."""
    request = ALLOWING.decode(FakeRecord(b"{broken", headers=[(protocol.REPLY_TO, b"elsewhere"),
                                                              (protocol.DEADLINE_MS, b"soon")]))
    assert request.dead_letter and request.reply_topic == "replies" and request.error.code == ErrorCode.BAD_REQUEST


def test_an_ok_request_without_a_result_gets_an_internal_error_reply_not_a_crash():
    request = DECODER.decode(FakeRecord(b"1"))
    value = orjson.loads(answers.reply_value(request))
    assert value["error"]["code"] == "internal_error"
    (reply,) = answers.answer(request, "dead-letters", now=1.0)  # the delivery's outcome; the request is not written
    assert reply.outcome is not None and reply.outcome.code == ErrorCode.INTERNAL_ERROR and request.ok
    assert dict(reply.record[3])[protocol.ERROR_CODE] == b"internal_error"


def test_a_request_nested_deeper_than_the_limit_is_a_bad_request_at_decode():
    """Issue 20, defect 1: an 807-byte ``{"x": [[[...400 deep...]]]}`` was decoded, and then failed its whole
    micro-batch in the stages. It is refused at decode time now, alone."""
    decoder = requests.RequestDecoder("replies", max_request_bytes=1000)
    deep = b'{"x": ' + b"[" * 400 + b"]" * 400 + b"}"
    request = decoder.decode(FakeRecord(deep))
    assert request.error.code == ErrorCode.BAD_REQUEST and request.dead_letter
    assert f"deeper than {protocol.MAX_JSON_DEPTH}" in request.error.message
    at_limit = b"[" * protocol.MAX_JSON_DEPTH + b"]" * protocol.MAX_JSON_DEPTH
    assert decoder.decode(FakeRecord(at_limit)).ok
    # Many brackets side by side are no nesting.
    assert decoder.decode(FakeRecord(b"[" + b",".join([b"[[1]]"] * 100) + b"]")).ok


def test_nesting_is_read_from_the_bytes_and_brackets_in_strings_do_not_count():
    assert jsonscan.nested_within(b"1", 0) and jsonscan.nested_within(b"[]", 1) and not jsonscan.nested_within(b"[]", 0)
    assert jsonscan.nested_within(b'{"a": [{"b": []}]}', 4) and not jsonscan.nested_within(b'{"a": [{"b": []}]}', 3)
    text = b'"' + b"[{" * 50 + b'"'
    assert jsonscan.nested_within(b'{"a": [' + text + b"]}", 2)
    # Escaped quotes and backslashes do not end a string early: the brackets after them are still inside it.
    for escaped in (rb'\"', rb"\\", rb"\\\"", rb"x\\"):
        value = b'["' + escaped + b"[[[[" + b'"]'
        assert orjson.loads(value) and jsonscan.nested_within(value, 1), value
    # A string ending in an escaped backslash ends there: the brackets after it nest.
    assert not jsonscan.nested_within(b'["a\\\\", [[[]]]]', 3)


def test_a_wide_or_deep_value_costs_about_what_a_normal_value_of_its_size_costs():
    """Issue 29, item 4: a 960 KB ``[[],[],...]`` cost ~1.9 s in the poll thread (the parse, with the garbage
    collector running over and over, then a Python walk of 320,000 lists). The nesting is now read from the bytes
    and the collector waits for the parse: the cost per byte stays within a small factor (5x wide, 8x deep: orjson's
    own parse of nested lists) of a list of short strings (the densest ordinary value) of the same size; before,
    32x wide. A ratio of runs taken in turns, not a time, so that a loaded machine does not fail it."""
    size = 480_000
    decoder = requests.RequestDecoder("replies", max_request_bytes=size + 100)
    normal = b"[" + b",".join([b'"ab"'] * (size // 5)) + b"]"
    wide = b"[" + b",".join([b"[]"] * (size // 3)) + b"]"
    deep = b"[" + b",".join([b"[" * 60 + b"]" * 60] * (size // 121)) + b"]"
    assert decoder.decode(FakeRecord(wide)).ok and decoder.decode(FakeRecord(deep)).ok
    for name, value in (("wide", wide), ("deep", deep)):
        ratio = cost_ratio(lambda value=value: decoder.decode(FakeRecord(value)),
                           lambda: decoder.decode(FakeRecord(normal)))
        assert ratio < 15, f"a {len(value)}-byte {name} value costs {ratio:.1f}x a normal one of {len(normal)} bytes"


def _with_a_null_slot(index: int) -> tuple:
    """A 2-tuple with nothing in slot ``index``: what confluent-kafka leaves where a header name is not UTF-8."""
    pythonapi = ctypes.pythonapi
    pythonapi.PyTuple_New.restype, pythonapi.PyTuple_New.argtypes = ctypes.py_object, [ctypes.c_ssize_t]
    broken = pythonapi.PyTuple_New(2)
    item = b"x"
    pythonapi.Py_IncRef(ctypes.py_object(item))  # the tuple's own reference
    pointer = ctypes.sizeof(ctypes.c_void_p)
    ctypes.c_void_p.from_address(id(broken) + tuple.__basicsize__ + (1 - index) * pointer).value = id(item)
    return broken


def test_headers_with_a_null_slot_are_found_without_reading_it():
    assert requests._intact([("a", b"1"), ("b", None)]) and requests._intact([])
    for index in (0, 1):
        assert not requests._intact([("a", b"1"), _with_a_null_slot(index)])
        assert not requests._intact([_with_a_null_slot(index), ("a", b"1")])
    assert not requests._intact([("a",)]) and not requests._intact([["a", b"1"]])
