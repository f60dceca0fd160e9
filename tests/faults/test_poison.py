"""Poison input (issue 4, item 3): every bad record gets exactly one error reply with its code (and a
dead letter when it cannot be read as a request), its batch neighbours succeed, the service lives on.

Poison and valid requests are produced together to a one-partition topic and batched by the static
policy with ``max_batch_size`` equal to the number of records that reach the batcher (those that pass
the handler's ``validate`` at admission), so they all share one batch: every one of them reports that
batch size in ``kinference-batch-size``, and the handler (``poison_handlers.Poison``) records the batches
it computed.
"""

from __future__ import annotations

import struct
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import orjson
import pytest
from confluent_kafka import Message
from confluent_kafka.admin import AdminClient

from kinference import protocol
from kinference.consumer.service import Service
from kinference.protocol import ErrorCode
from tests import conftest
from tests.faults.harness import Group
from tests.faults.poison_handlers import Poison
from tests.integration.kafka_io import headers_of, produce, read, service_config

pytestmark = [pytest.mark.integration, pytest.mark.faults]

READY_S = 30
MAX_REQUEST_BYTES = 4096
MAX_HEADER_BYTES = 1024
KNOWN_CODES = {str(code) for code in ErrorCode}
# Tight limits keep a test short when the service is broken: a dead thread leaves work unanswered.
FAST_STOP = {"shutdown_grace_s": 3.0, "rebalance_drain_ms": 500}
_NONE_S = 3.0
"""How long a read waits for records that must not exist, once every answer is in."""


@dataclass(frozen=True)
class Case:
    """One request record and the outcome the protocol promises for it (``code`` None: ok)."""

    key: bytes
    value: bytes | None
    headers: list = field(default_factory=list)
    code: ErrorCode | None = None
    dead: bool = False
    """Unreadable as a request: an error reply *and* a dead letter; never batched."""
    admitted: bool = True
    """False: the handler's ``validate`` rejects it as it arrives, so it never takes a place in a batch."""

    @property
    def batched(self) -> bool:
        return not self.dead and self.admitted

    @property
    def record(self) -> tuple[bytes, bytes | None, list]:
        return self.key, self.value, self.headers


def _json(payload: object) -> bytes:
    return orjson.dumps(payload)


def unreadable_cases() -> list[Case]:
    """Records the decoder rejects: error reply + dead letter, never batched."""
    bad, large = ErrorCode.BAD_REQUEST, ErrorCode.PAYLOAD_TOO_LARGE
    rows = [
        ("malformed-json", b'{"n": 1,', [], bad),
        ("trailing-garbage", b'{"n": 1} }', [], bad),
        ("non-utf8", b'{"n": 1, "s": "\xff\xfe"}', [], bad),
        ("utf8-bom", b'\xef\xbb\xbf{"n": 1}', [], bad),
        ("lone-surrogate", b'{"n": 1, "s": "\\ud800"}', [], bad),
        ("nan-literal", b'{"n": NaN}', [], bad),
        ("infinite-number", b'{"n": 1e400}', [], bad),
        ("nested-2000", b"[" * 2000 + b"]" * 2000, [], bad),
        ("nul-byte", b"\x00", [], bad),
        ("empty", b"", [], bad),
        ("tombstone", None, [], bad),
        ("oversized-value", _json({"n": 1, "pad": "x" * MAX_REQUEST_BYTES}), [], large),
        ("oversized-header", b'{"n": 1}', [("x-pad", b"x" * (MAX_HEADER_BYTES + 1))], large),
        ("many-headers", b'{"n": 1}', [(f"h{i}", b"v") for i in range(MAX_HEADER_BYTES // 3)], large),
        ("deadline-not-a-number", b'{"n": 1}', [(protocol.DEADLINE_MS, b"soon")], bad),
        ("deadline-not-ascii", b'{"n": 1}', [(protocol.DEADLINE_MS, "١٢٣".encode())], bad),
        ("correlation-not-utf8", b'{"n": 1}', [(protocol.CORRELATION_ID, b"\xff\xfe")], bad),
        ("correlation-empty", b'{"n": 1}', [(protocol.CORRELATION_ID, b"")], bad),
        ("correlation-too-long", b'{"n": 1}', [(protocol.CORRELATION_ID, b"c" * 257)], bad),
        ("reply-to-illegal", b'{"n": 1}', [(protocol.REPLY_TO, b"no such topic!")], bad),
        ("reply-to-dotdot", b'{"n": 1}', [(protocol.REPLY_TO, b"..")], bad),
        ("spring-topic-not-utf8", b'{"n": 1}', [(protocol.SPRING_REPLY_TOPIC, b"\xc3\x28")], bad),
        ("spring-partition-short", b'{"n": 1}', [(protocol.SPRING_REPLY_PARTITION, b"\x01")], bad),
        ("spring-partition-negative", b'{"n": 1}', [(protocol.SPRING_REPLY_PARTITION, struct.pack(">i", -1))], bad),
    ]
    return [Case(key.encode(), value, headers, code, dead=True) for key, value, headers, code in rows]


def batched_cases() -> list[Case]:
    """Readable records: rejected one by one at admission, failed one by one inside the batch, or ok."""
    bad, handler = ErrorCode.BAD_REQUEST, ErrorCode.HANDLER_ERROR
    refused = [
        # Wrong types and missing fields: the handler's validate rejects that request alone.
        ("array", b"[1, 2]", bad),
        ("null", b"null", bad),
        ("string", b'"text"', bad),
        ("missing-field", _json({"m": 1}), bad),
        ("wrong-type", _json({"n": "1"}), bad),
        ("bool-not-int", _json({"n": True}), bad),
        ("validate-raises", _json({"n": 1, "poison": "validate_crash"}), handler),
    ]
    failed_in_batch = [  # a handler that fails on one item of the batch
        ("item-error-slot", _json({"n": 2, "poison": "item_error"}), bad),
        ("result-unserialisable", _json({"n": 3, "poison": "unserialisable"}), handler),
        ("result-too-deep", _json({"n": 4, "poison": "deep"}), handler),
    ]
    cases = [Case(key.encode(), value, [], code, admitted=False) for key, value, code in refused]
    cases += [Case(key.encode(), value, [], code) for key, value, code in failed_in_batch]
    cases += [Case(f"valid-{i}".encode(), _json({"n": 100 + i}), [(protocol.CORRELATION_ID, f"v{i}".encode())])
              for i in range(6)]
    # Garbage that is no reason to refuse a request: unknown and empty names, binary values, None values
    # of known headers (ignored), a repeated correlation id (the last wins).
    cases += [
        Case(b"noise-headers", _json({"n": 200}), [("x-binary", bytes(range(64))), ("", b""),
                                                   (protocol.CORRELATION_ID, None), (protocol.DEADLINE_MS, None),
                                                   (protocol.REPLY_TO, None), ("Kinference-Reply-To", b"!!")]),
        Case(b"repeated-correlation", _json({"n": 201}), [(protocol.CORRELATION_ID, b"first"),
                                                          (protocol.CORRELATION_ID, b"second")]),
    ]
    return cases


# --- helpers ------------------------------------------------------------------------------------


@contextmanager
def serving(broker, topics: dict[str, str], handler, **overrides) -> Iterator[Service]:
    config = service_config(broker.bootstrap_servers, topics, metrics=False, **{**FAST_STOP, **overrides})
    with Service(config, handler=handler) as service:
        assert service.wait_ready(READY_S)
        yield service


def collect(service: Service, bootstrap: str, topic: str, count: int, timeout_s: float = 30.0,
            settle_s: float = 1.0) -> list[Message]:
    """Read ``topic`` until ``count`` records came, giving up early once a service thread has died."""
    deadline = time.monotonic() + timeout_s
    records: list[Message] = []
    while time.monotonic() < deadline:
        records = read(bootstrap, topic, count, timeout_s=min(2.0, deadline - time.monotonic()))
        if len(records) >= count or not service.healthy:
            break
    if settle_s and len(records) >= count:
        records = read(bootstrap, topic, count, settle_s=settle_s)  # duplicates would show up too
    return records


def by_key(records: list[Message]) -> dict[bytes, Message]:
    counts = Counter(record.key() for record in records)
    repeated = {key: n for key, n in counts.items() if n > 1}
    assert not repeated, f"more than one record for {repeated}"
    return {record.key(): record for record in records}


def code_of(reply: Message) -> str | None:
    """The reply's error code (None when ok), checked to agree between headers and value."""
    headers, body = headers_of(reply), orjson.loads(reply.value())
    if headers[protocol.STATUS] == b"ok":
        assert "result" in body and protocol.ERROR_CODE not in headers
        return None
    assert headers[protocol.STATUS] == b"error"
    assert body["error"]["code"] == headers[protocol.ERROR_CODE].decode() and body["error"]["message"]
    return body["error"]["code"]


def ask_ok(service: Service, bootstrap: str, topics: dict[str, str], n: int = 999) -> float:
    """A valid request after the poison: answered ok (seconds it took)."""
    key = f"after-{uuid.uuid4().hex[:6]}".encode()
    started = time.monotonic()
    produce(bootstrap, topics["requests"], [(key, _json({"n": n}), [])])
    deadline = started + 20
    while time.monotonic() < deadline:
        replies = {m.key(): m for m in read(bootstrap, topics["replies"], 1 << 30, timeout_s=0.5)}
        if key in replies:
            assert code_of(replies[key]) is None, replies[key].value()
            return time.monotonic() - started
        assert service.healthy, f"a service thread died: {service.health_checks()}"
    raise AssertionError("a valid request after the poison got no reply within 20 s")


def check_dead_letters(dead: list[Message], cases: list[Case], topic: str) -> None:
    letters = by_key(dead)
    expected = {case.key: case for case in cases if case.dead}
    assert set(letters) == set(expected), f"dead letters {sorted(letters)} != {sorted(expected)}"
    for key, letter in letters.items():
        case, headers = expected[key], headers_of(letter)
        assert headers[protocol.ERROR_CODE] == str(case.code).encode(), key
        assert headers[protocol.ERROR_MESSAGE] and headers[protocol.SOURCE_TOPIC] == topic.encode()
        assert int(headers[protocol.SOURCE_OFFSET]) >= 0 and headers[protocol.SOURCE_PARTITION] == b"0"
        assert (letter.value() or b"") == (case.value or b""), f"{key}: the original value is kept"
        assert letter.headers()[: len(case.headers)] == case.headers, f"{key}: the original headers are kept"


# --- tests --------------------------------------------------------------------------------------


def test_each_poison_record_gets_one_error_reply_and_its_batch_neighbours_succeed(broker):
    topics = broker.topics(requests=1, replies=1, dead=1)
    cases = unreadable_cases() + batched_cases()
    cases.sort(key=lambda case: case.key)  # poison interleaved with valid requests, in one deterministic order
    batched = [case for case in cases if case.batched]
    handler = Poison()
    with serving(broker, topics, handler, batch_policy="static", max_batch_size=len(batched),
                 max_batch_delay_ms=1500, max_request_bytes=MAX_REQUEST_BYTES,
                 max_header_bytes=MAX_HEADER_BYTES) as service:
        produce(broker.bootstrap_servers, topics["requests"], [case.record for case in cases],
                **{"enable.idempotence": True})
        replies = by_key(collect(service, broker.bootstrap_servers, topics["replies"], len(cases)))
        dead = read(broker.bootstrap_servers, topics["dead"], len(unreadable_cases()), settle_s=0.5)
        assert service.healthy, service.health_checks()
        ask_ok(service, broker.bootstrap_servers, topics)

    assert set(replies) == {case.key for case in cases}, "exactly one reply per request"
    for case in cases:
        reply = replies[case.key]
        assert code_of(reply) == (str(case.code) if case.code else None), (case.key, reply.value())
        headers = headers_of(reply)
        if case.batched:  # all of them in the one batch of len(batched)
            assert headers[protocol.BATCH_SIZE] == str(len(batched)).encode(), case.key
        else:
            assert protocol.BATCH_SIZE not in headers, f"{case.key}: unreadable or refused records are never batched"
        if case.code is None:
            assert orjson.loads(reply.value()) == {"result": orjson.loads(case.value)}
    assert headers_of(replies[b"repeated-correlation"])[protocol.CORRELATION_ID] == b"second"
    check_dead_letters(dead, cases, topics["requests"])
    # The handler computed one batch: every item that passed validate, in offset order.
    validated = [orjson.loads(case.value) for case in batched]
    assert handler.record.preprocessed[0] == validated
    assert handler.record.inferred[0] == validated


def test_a_failing_micro_batch_fails_alone_and_the_rest_of_its_batch_succeeds(broker):
    """preprocess or inference raising, or postprocess returning the wrong number (or a non-list) of
    results, fails the requests of that micro-batch with handler_error; the batch's other micro-batches
    are answered ok."""
    topics = broker.topics(requests=1, replies=1, dead=1)
    faults = ["batch_crash", "wrong_count", "preprocess_crash", "not_a_list", None]
    messages = {"batch_crash": "inference failed", "wrong_count": "3 results for 4 requests",
                "preprocess_crash": "preprocess failed", "not_a_list": "returned dict results for 4 requests"}
    records, expected = [], {}
    for part, fault in enumerate(faults):  # micro-batch `part` = offsets 4*part .. 4*part+3
        for i in range(4):
            n = 4 * part + i
            payload = {"n": n, "poison": fault} if i == 0 and fault else {"n": n}
            records.append((f"r{n:02d}".encode(), _json(payload), []))
            expected[f"r{n:02d}".encode()] = fault
    handler = Poison()
    with serving(broker, topics, handler, batch_policy="static", max_batch_size=len(records),
                 max_batch_delay_ms=1500, micro_batch_size=4) as service:
        produce(broker.bootstrap_servers, topics["requests"], records, **{"enable.idempotence": True})
        replies = by_key(collect(service, broker.bootstrap_servers, topics["replies"], len(records)))
        assert service.healthy, service.health_checks()
        ask_ok(service, broker.bootstrap_servers, topics)

    assert set(replies) == set(expected)
    for key, fault in expected.items():
        reply = replies[key]
        assert headers_of(reply)[protocol.BATCH_SIZE] == str(len(records)).encode(), "one batch of 20"
        if fault is None:
            assert code_of(reply) is None, key
        else:
            assert code_of(reply) == "handler_error", key
            assert messages[fault] in orjson.loads(reply.value())["error"]["message"], key
    assert read(broker.bootstrap_servers, topics["dead"], 1, timeout_s=1.0) == [], "handler errors are no dead letters"


# JSON has no NaN or infinity; orjson would write null and the reply would look fine.
def test_non_finite_numbers_in_a_result_fail_that_request_with_handler_error(broker):
    topics = broker.topics(requests=1, replies=1, dead=1)
    faults = ["nan", "inf", "-inf", "np_nan"]
    records = [(f.encode(), _json({"n": i, "poison": f}), []) for i, f in enumerate(faults)]
    records += [(f"ok-{i}".encode(), _json({"n": 10 + i}), []) for i in range(2)]
    with serving(broker, topics, Poison(), batch_policy="static", max_batch_size=len(records),
                 max_batch_delay_ms=1500) as service:
        produce(broker.bootstrap_servers, topics["requests"], records, **{"enable.idempotence": True})
        replies = by_key(collect(service, broker.bootstrap_servers, topics["replies"], len(records)))
        assert service.healthy
    assert {key: code_of(reply) for key, reply in replies.items()} == {
        b"nan": "handler_error", b"inf": "handler_error", b"-inf": "handler_error", b"np_nan": "handler_error",
        b"ok-0": None, b"ok-1": None,
    }


# Producer.produce() refuses some records at once (MSG_SIZE_TOO_LARGE, _UNKNOWN_PARTITION, _UNKNOWN_TOPIC);
# each must end as an error reply or a dead letter, never as a dead publisher thread.
@pytest.mark.parametrize("fault", ["reply-too-large", "dead-letter-too-large", "reply-partition-out-of-range"])
def test_a_reply_or_dead_letter_the_producer_refuses_does_not_kill_the_service(broker, fault):
    topics = broker.topics(requests=1, replies=1, dead=1)
    limits = {"max_request_bytes": MAX_REQUEST_BYTES} if fault == "dead-letter-too-large" else {}
    if fault == "reply-partition-out-of-range":
        poison = (b"poison", _json({"n": 1}), [(protocol.SPRING_REPLY_PARTITION, struct.pack(">i", 5))])
    else:  # a valid request just under the client's 1000000-byte limit: its echo reply is over it
        poison = (b"poison", _json({"n": 1, "pad": "a" * 999_900}), [])
    with serving(broker, topics, Poison(), **limits) as service:
        ask_ok(service, broker.bootstrap_servers, topics, n=0)  # the reply topic's metadata is now cached
        produce(broker.bootstrap_servers, topics["requests"], [poison, (b"neighbour", _json({"n": 2}), [])])
        replies = by_key(collect(service, broker.bootstrap_servers, topics["replies"], 3, timeout_s=20))
        assert service.healthy, f"a service thread died: {service.health_checks()}"
        wait_s = 10 if fault == "dead-letter-too-large" else 3  # a dead letter is promised for it alone
        dead = by_key(read(broker.bootstrap_servers, topics["dead"], 1, timeout_s=wait_s))
        assert code_of(replies[b"neighbour"]) is None
        if fault == "reply-too-large":  # answered with an error the client can read
            assert code_of(replies[b"poison"]) in KNOWN_CODES
        elif fault == "dead-letter-too-large":
            assert code_of(replies[b"poison"]) == "payload_too_large"
            assert headers_of(dead[b"poison"])[protocol.ERROR_CODE] == b"payload_too_large"
        else:  # checked against the reply topic's metadata first (issue 20, defect 3): answered on the default one
            assert code_of(replies[b"poison"]) == "bad_request"
            assert replies[b"poison"].partition() == 0
        ask_ok(service, broker.bootstrap_servers, topics)


# --- a reply-to topic that does not exist -------------------------------------------------------


def test_an_allowed_reply_topic_that_does_not_exist_is_answered_at_once_and_never_created(broker):
    """Issue 29, items 7 and 8: a request naming an allowed reply topic that does not exist is answered
    reply_topic_not_found on the default reply topic at once, and the topic is not created; internal topics are
    never allowed, whatever the pattern (``*`` here). Before: on Tansu, which creates any topic a metadata request
    names, the reply created the topic; on Apache Kafka (auto-creation off) the reply waited out librdkafka's 30 s
    and was dead-lettered with internal_error, holding a place in flight all that time."""
    topics = broker.topics(requests=1, replies=1, dead=1)
    missing = {f"to-missing-{i}".encode(): f"missing-{uuid.uuid4().hex[:10]}" for i in range(3)}
    internal = {b"to-offsets": "__consumer_offsets", b"to-schemas": "_schemas"}
    records = [(key, _json({"n": i}), [(protocol.REPLY_TO, topic.encode()), (protocol.CORRELATION_ID, key)])
               for i, (key, topic) in enumerate({**missing, **internal}.items())]
    with serving(broker, topics, Poison(), reply_topics_allowed=["*"]) as service:
        started = time.monotonic()
        produce(broker.bootstrap_servers, topics["requests"], [*records, (b"neighbour", _json({"n": 9}), [])])
        replies = by_key(collect(service, broker.bootstrap_servers, topics["replies"], len(records) + 1,
                                 timeout_s=40))
        answered_s = time.monotonic() - started
        assert service.healthy, service.health_checks()
    assert {key: code_of(reply) for key, reply in replies.items()} == {
        **dict.fromkeys(missing, "reply_topic_not_found"), **dict.fromkeys(internal, "reply_topic_not_allowed"),
        b"neighbour": None}
    print(f"reply topics: {len(records) + 1} answers in {answered_s:.2f} s ({len(missing)} to missing topics)")
    assert answered_s < 10, f"the answers took {answered_s:.1f} s: a missing topic's reply waited in flight"
    existing = AdminClient({"bootstrap.servers": broker.bootstrap_servers}).list_topics(timeout=10).topics
    assert not set(missing.values()) & set(existing), "kinference must not have created the topics"
    assert read(broker.bootstrap_servers, topics["dead"], 1, timeout_s=_NONE_S) == []


def test_on_a_broker_that_auto_creates_topics_requests_create_none():
    """Issue 29, item 7, on Apache Kafka as it ships (``auto.create.topics.enable=true``; the suite's own broker has
    it off): 55 requests naming allowed topics that did not exist made 55 topics, through the producer's metadata
    requests. Each gets reply_topic_not_found now, and no topic is made."""
    if conftest.BROKER_KIND != "kafka":
        pytest.skip("starts an Apache Kafka broker that auto-creates topics: KINFERENCE_TEST_BROKER=kafka")
    from kinference.consumer.brokers.apache_kafka import ApacheKafkaBroker

    with ApacheKafkaBroker(properties={"auto.create.topics.enable": "true"}) as kafka:
        auto = conftest.TestBroker(kafka.bootstrap_servers, "kafka")
        topics = auto.topics(requests=1, replies=1, dead=1)
        missing = {f"to-{i}".encode(): f"missing-{uuid.uuid4().hex[:10]}" for i in range(5)}
        with serving(auto, topics, Poison(), reply_topics_allowed=["missing-*"]) as service:
            produce(auto.bootstrap_servers, topics["requests"],
                    [(key, _json({"n": 1}), [(protocol.REPLY_TO, topic.encode())]) for key, topic in missing.items()])
            replies = by_key(collect(service, auto.bootstrap_servers, topics["replies"], len(missing), timeout_s=30))
        existing = AdminClient({"bootstrap.servers": auto.bootstrap_servers}).list_topics(timeout=10).topics
    assert {key: code_of(reply) for key, reply in replies.items()} == dict.fromkeys(missing, "reply_topic_not_found")
    assert not set(missing.values()) & set(existing), "a request made a topic"


def test_a_reply_topic_outside_the_allow_list_gets_an_error_reply_on_the_default_topic(broker):
    """The reply-to header is not an open relay: a request naming the service's own request topic, its
    dead-letter topic or any topic not allowed is answered with reply_topic_not_allowed on the default reply
    topic, and nothing is written where it asked."""
    topics = broker.topics(requests=1, replies=1, dead=1, elsewhere=1, team=1)
    asks = {b"own-requests": topics["requests"], b"dead-letters": topics["dead"], b"elsewhere": topics["elsewhere"],
            b"allowed": topics["team"]}
    records = [(key, _json({"n": i}), [(protocol.REPLY_TO, topic.encode()), (protocol.CORRELATION_ID, key)])
               for i, (key, topic) in enumerate(asks.items())]
    with serving(broker, topics, Poison(), reply_topics_allowed=["team-*"]) as service:
        produce(broker.bootstrap_servers, topics["requests"], records)
        replies = by_key(collect(service, broker.bootstrap_servers, topics["replies"], 3, timeout_s=20))
        allowed = by_key(collect(service, broker.bootstrap_servers, topics["team"], 1, timeout_s=20))
        # Every answer is in: a record written where it should not be would have been written before it. Reading
        # one record more than may exist waits out the short timeout.
        requests_topic = read(broker.bootstrap_servers, topics["requests"], len(records) + 1, timeout_s=_NONE_S)
        assert service.healthy
    assert {key: code_of(reply) for key, reply in replies.items()} == {
        b"own-requests": "reply_topic_not_allowed", b"dead-letters": "reply_topic_not_allowed",
        b"elsewhere": "reply_topic_not_allowed"}
    assert set(allowed) == {b"allowed"} and code_of(allowed[b"allowed"]) is None
    assert len(requests_topic) == len(records), "nothing was written back to the request topic"
    assert read(broker.bootstrap_servers, topics["elsewhere"], 1, timeout_s=_NONE_S) == []
    assert read(broker.bootstrap_servers, topics["dead"], 1, timeout_s=_NONE_S) == []


# --- the real process ---------------------------------------------------------------------------


def test_kinference_serve_process_survives_poison_and_keeps_answering(fault_settings):
    """Every readable-or-not poison record through a real ``kinference serve`` (default batching): the
    process keeps running, answers each record once with its code, and stops cleanly on SIGTERM."""
    settings = fault_settings(1)
    cases = unreadable_cases() + batched_cases()
    extra = ["--handler", "tests.faults.poison_handlers:Poison", "--max-request-bytes", str(MAX_REQUEST_BYTES),
             "--max-header-bytes", str(MAX_HEADER_BYTES), "--shutdown-grace-s", "10"]
    with Group(settings) as group:
        member = group.start(extra=extra)
        group.wait_stable(60)
        for _round in range(2):  # the same poison twice: nothing about it accumulates
            produce(settings.bootstrap, settings.topics["requests"], [case.record for case in cases])
        produce(settings.bootstrap, settings.topics["requests"], [(b"after", _json({"n": 1}), [])])
        replies = read(settings.bootstrap, settings.topics["replies"], 2 * len(cases) + 1, settle_s=1.0)
        dead = read(settings.bootstrap, settings.topics["dead"], 2 * len(unreadable_cases()), settle_s=0.5)
        assert member.running, member.tail()
        member.terminate()
        assert member.wait_exit(30) == 0, member.tail()
    counts = Counter(reply.key() for reply in replies)
    assert counts == Counter({**{case.key: 2 for case in cases}, b"after": 1}), "one reply per request"
    expected = {case.key: str(case.code) if case.code else None for case in cases} | {b"after": None}
    assert {reply.key(): code_of(reply) for reply in replies} == expected
    assert Counter(letter.key() for letter in dead) == Counter({case.key: 2 for case in cases if case.dead})
    assert not any("died" in line for line in member.lines), member.tail()
