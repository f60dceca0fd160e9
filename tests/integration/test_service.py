"""End-to-end behaviour of the service on a real broker (Tansu, or Apache Kafka via testcontainers)."""

from __future__ import annotations

import struct
import time
from collections import Counter

import orjson
import pytest

from kinference import protocol
from kinference.consumer.service import Service
from tests.conftest import NO_THREAD_DIES
from tests.integration.kafka_io import committed, headers_of, produce, read, service_config

pytestmark = [pytest.mark.integration, NO_THREAD_DIES]

READY_S = 30


@pytest.fixture
def topics(broker):
    return broker.topics(requests=3, replies=1, dead=1)


def test_end_to_end_mixed_valid_and_malformed(broker, topics):
    records, malformed = [], set()
    for i in range(2000):
        cid = f"req-{i}".encode()
        if i % 7 == 3:
            value = [b"{not json", b"\xff\xfe\x00", b"", b'{"a": '][i % 4]
            malformed.add(cid)
        else:
            value = orjson.dumps({"i": i, "text": "x" * (i % 50)})
        records.append((f"key-{i}".encode(), value, [(protocol.CORRELATION_ID, cid)]))
    config = service_config(broker.bootstrap_servers, topics, max_batch_size=16, micro_batch_size=4,
                            parallelism={"preprocess": 2, "inference": 1, "postprocess": 2})
    with Service(config) as service:
        assert service.wait_ready(READY_S)
        produced = produce(broker.bootstrap_servers, topics["requests"], records)
        assert len(produced.ends) == 3, "requests should spread over 3 partitions"
        replies = read(broker.bootstrap_servers, topics["replies"], len(records), settle_s=1.0)
        dead = read(broker.bootstrap_servers, topics["dead"], len(malformed), settle_s=0.5)

    by_id = Counter(headers_of(m)[protocol.CORRELATION_ID] for m in replies)
    assert len(replies) == 2000 and set(by_id.values()) == {1}, "exactly one reply per request"
    sent = {cid: (key, value) for key, value, [(_, cid)] in records}
    assert set(by_id) == set(sent)
    for message in replies:
        cid = headers_of(message)[protocol.CORRELATION_ID]
        key, value = sent[cid]
        assert message.key() == key
        body = orjson.loads(message.value())
        if cid in malformed:
            assert headers_of(message)[protocol.STATUS] == b"error"
            assert body["error"]["code"] == "bad_request"
        else:
            assert headers_of(message)[protocol.STATUS] == b"ok"
            assert body == {"result": orjson.loads(value)}
            assert 1 <= int(headers_of(message)[protocol.BATCH_SIZE]) <= 16
    assert len(dead) == len(malformed)
    assert {headers_of(m)[protocol.CORRELATION_ID] for m in dead} == malformed
    for message in dead:
        headers = headers_of(message)
        assert headers[protocol.ERROR_CODE] == b"bad_request"
        assert headers[protocol.SOURCE_TOPIC] == topics["requests"].encode()
        assert message.value() == sent[headers[protocol.CORRELATION_ID]][1] or not message.value()


def test_reply_to_and_spring_headers_are_honoured(broker, topics):
    extra = broker.topics(custom=1, spring=2)
    spring_id = bytes(range(16))
    records = [
        (b"a", b'"to-custom"', [(protocol.CORRELATION_ID, b"c-custom"), (protocol.REPLY_TO, extra["custom"].encode())]),
        (b"b", b'"to-spring"', [
            (protocol.SPRING_CORRELATION_ID, spring_id),
            (protocol.SPRING_REPLY_TOPIC, extra["spring"].encode()),
            (protocol.SPRING_REPLY_PARTITION, struct.pack(">i", 1)),
        ]),
        (b"c", b'"to-default"', []),
    ]
    allowed = [extra["custom"], "spring-*"]  # a name and a pattern
    with Service(service_config(broker.bootstrap_servers, topics, reply_topics_allowed=allowed)) as service:
        assert service.wait_ready(READY_S)
        produced = produce(broker.bootstrap_servers, topics["requests"], records[2:])
        produce(broker.bootstrap_servers, topics["requests"], records[:2])
        custom = read(broker.bootstrap_servers, extra["custom"], 1)
        spring = read(broker.bootstrap_servers, extra["spring"], 1, partitions=[1])
        default = read(broker.bootstrap_servers, topics["replies"], 1)
    assert [orjson.loads(m.value()) for m in custom] == [{"result": "to-custom"}]
    assert headers_of(custom[0])[protocol.CORRELATION_ID] == b"c-custom" and custom[0].key() == b"a"
    assert len(spring) == 1 and spring[0].partition() == 1
    assert headers_of(spring[0])[protocol.SPRING_CORRELATION_ID] == spring_id
    assert orjson.loads(spring[0].value()) == {"result": "to-spring"}
    # No correlation header at all: the id is derived from where the request was stored.
    ((topic, partition),) = produced.ends
    assert headers_of(default[0])[protocol.CORRELATION_ID] == f"{topic}/{partition}/0".encode()


def test_two_request_topics_one_consumer(broker, topics):
    second = broker.topics(requests=2)["requests"]
    config = service_config(broker.bootstrap_servers, topics, request_topics=[topics["requests"], second])
    with Service(config) as service:
        assert service.wait_ready(READY_S)
        produce(broker.bootstrap_servers, topics["requests"], [(None, b'"one"', [])] * 20)
        produce(broker.bootstrap_servers, second, [(None, b'"two"', [])] * 30)
        replies = read(broker.bootstrap_servers, topics["replies"], 50, settle_s=0.5)
    assert Counter(orjson.loads(m.value())["result"] for m in replies) == {"one": 20, "two": 30}


def test_expired_deadline_gets_deadline_exceeded_without_compute(broker, topics):
    past = str(int(time.time() * 1000) - 1000).encode()
    future = str(int(time.time() * 1000) + 60_000).encode()
    with Service(service_config(broker.bootstrap_servers, topics)) as service:
        assert service.wait_ready(READY_S)
        produce(broker.bootstrap_servers, topics["requests"], [
            (b"late", b'"x"', [(protocol.CORRELATION_ID, b"late"), (protocol.DEADLINE_MS, past)]),
            (b"fine", b'"y"', [(protocol.CORRELATION_ID, b"fine"), (protocol.DEADLINE_MS, future)]),
        ])
        replies = {headers_of(m)[protocol.CORRELATION_ID]: m for m in read(
            broker.bootstrap_servers, topics["replies"], 2)}
    late = orjson.loads(replies[b"late"].value())
    assert late["error"]["code"] == "deadline_exceeded"
    assert protocol.BATCH_SIZE not in headers_of(replies[b"late"])  # never batched or computed
    assert orjson.loads(replies[b"fine"].value()) == {"result": "y"}


def test_clean_stop_commits_everything_and_restart_reprocesses_nothing(broker, topics):
    config = service_config(broker.bootstrap_servers, topics, commit_interval_ms=60_000)  # only stop commits
    records = [(str(i).encode(), orjson.dumps(i), []) for i in range(300)]
    with Service(config) as service:
        assert service.wait_ready(READY_S)
        produced = produce(broker.bootstrap_servers, topics["requests"], records)
        assert len(read(broker.bootstrap_servers, topics["replies"], 300)) == 300
    assert committed(broker.bootstrap_servers, config.group_id, list(produced.ends)) == dict(produced.ends)

    with Service(config) as service:
        assert service.wait_ready(READY_S)
        time.sleep(2.0)  # time to (wrongly) re-serve anything
    replies = read(broker.bootstrap_servers, topics["replies"], 300, settle_s=1.0)
    assert len(replies) == 300, "a restarted service must not answer committed requests again"


def test_backpressure_pauses_and_loses_nothing(broker, topics):
    config = service_config(broker.bootstrap_servers, topics, handler="tests.integration.slow_handler:SlowEcho",
                            max_batch_size=4, max_in_flight=8, resume_in_flight=2, max_poll_records=10)
    paused_seen = False
    with Service(config) as service:
        assert service.wait_ready(READY_S)
        produce(broker.bootstrap_servers, topics["requests"], [(None, orjson.dumps(i), []) for i in range(200)])
        started = time.monotonic()
        max_in_flight = 0
        while time.monotonic() < started + 60:
            paused_seen |= service.source.paused
            if time.monotonic() > started + 1 and service.tracker.in_flight == 0 and not service.source.paused:
                break
            max_in_flight = max(max_in_flight, service.tracker.in_flight)
            time.sleep(0.005)
        replies = read(broker.bootstrap_servers, topics["replies"], 200, settle_s=0.5)
    assert paused_seen
    # The bound holds up to one poll's worth of records (fetched before the pause took effect).
    assert max_in_flight <= 8 + 10
    assert sorted(orjson.loads(m.value())["result"] for m in replies) == list(range(200))
