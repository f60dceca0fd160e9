"""How a ``kinference serve`` process ends (issue 11, items 5-7): within its shutdown deadline even when a
handler call never returns, and with exit code 1 (so that the orchestrator restarts it) when it cannot go on; and
that no record ends it (issue 29, item 2)."""

from __future__ import annotations

import time
import uuid

import orjson
import pytest

from kinference import protocol
from tests.faults.harness import Group, now_ms
from tests.integration.kafka_io import committed, headers_of, produce, read

pytestmark = [pytest.mark.integration, pytest.mark.faults]

GRACE_S = 6.0


@pytest.mark.timeout(90)
def test_sigterm_while_a_handler_is_stuck_exits_within_the_shutdown_deadline(fault_settings):
    """A request makes its inference call sleep for two minutes. SIGTERM: the process commits what was
    answered, leaves the group and exits by the deadline; the stuck request stays uncommitted (it is served
    again after a restart), and ``handler.close`` is skipped since the handler is still busy."""
    settings = fault_settings(1, extra=("--shutdown-grace-s", str(GRACE_S)))
    topic = settings.topics["requests"]
    with Group(settings) as group:
        member = group.start("stuck")
        group.wait_stable(40)
        produce(settings.bootstrap, topic, [(None, orjson.dumps({"seq": i}), []) for i in range(5)])
        time.sleep(2.0)  # answered and committed
        produce(settings.bootstrap, topic, [(None, orjson.dumps({"seq": 5, "stall_s": 120}), [])])
        time.sleep(1.0)  # inside the handler
        sigterm_ms = now_ms()
        member.terminate()
        code = member.wait_exit(GRACE_S + 10)
        took_s = (member.ended_ms - sigterm_ms) / 1000
    print(f"\nstuck handler: SIGTERM -> exit {code} after {took_s:.1f} s (deadline {GRACE_S:g} s)")
    assert code == 0, member.tail()
    assert took_s < GRACE_S + 2.0, member.tail()
    assert member.said("handler.close() is skipped"), member.tail()
    assert committed(settings.bootstrap, settings.group_id, [(topic, 0)]) == {(topic, 0): 5}


def wait_committed(settings, offset: int, timeout_s: float = 40.0) -> int:
    topic = settings.topics["requests"]
    deadline = time.monotonic() + timeout_s
    while (now := committed(settings.bootstrap, settings.group_id, [(topic, 0)])[(topic, 0)]) != offset:
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return now


@pytest.mark.timeout(90)
def test_a_request_nothing_can_answer_is_counted_and_committed_past_and_the_service_stays_up(fault_settings):
    """The dead-letter topic does not exist (and the producer may not create it), so a malformed request can be
    dead-lettered, nor, hence, answered in full. Issue 29, item 2: the service exited 1,
    and every start served the record again and exited again, a denial of service on the partition. Now the request
    is unanswerable, counted and logged, and the commit passes it; its neighbours are answered once."""
    missing = f"missing-dead-{uuid.uuid4().hex[:8]}"
    # librdkafka waits topic.metadata.propagation.max.ms (30 s by default) for a topic to appear: 2 s here.
    settings = fault_settings(1, extra=("--dead-letter-topic", missing,
                                        "--kafka-producer", "allow.auto.create.topics=false",
                                        "--kafka-producer", "topic.metadata.propagation.max.ms=2000"))
    topic = settings.topics["requests"]
    with Group(settings) as group:
        member = group.start("no-dead-letters")
        group.wait_stable(40)
        produce(settings.bootstrap, topic, [(None, orjson.dumps({"seq": 0}), []), (None, b"{not json", []),
                                            (None, orjson.dumps({"seq": 2}), [])])
        position = wait_committed(settings, 3)
        assert member.running, member.tail()
        member.terminate()
        code = member.wait_exit(30)
    assert position == 3 and code == 0, member.tail()
    assert member.said("unanswerable request"), member.tail()
    # The malformed request's error reply went out; only its dead letter could not.
    assert len(read(settings.bootstrap, settings.topics["replies"], 3, timeout_s=10, settle_s=0.5)) == 3


@pytest.mark.timeout(120)
def test_a_one_megabyte_key_is_answered_without_it_and_the_neighbours_once(fault_settings):
    """Issue 29, item 2: a ~1 MB key rode on the reply and on every dead letter, none of which the broker took; the
    request was unanswerable and the service exited 1 on every start, answering the requests around it again each
    time. The key is left out of its answers now (``--max-key-bytes``), and they say so."""
    settings = fault_settings(1)
    records = [(None, orjson.dumps({"seq": i}), [(protocol.CORRELATION_ID, b"%d" % i)]) for i in range(21)]
    records[10] = (b"k" * 1_000_000, orjson.dumps({"seq": 10}), [(protocol.CORRELATION_ID, b"10")])
    with Group(settings) as group:
        member = group.start("big-key")
        group.wait_stable(40)
        produce(settings.bootstrap, settings.topics["requests"], records, **{"message.max.bytes": "1100000"})
        position = wait_committed(settings, 21)
        replies = read(settings.bootstrap, settings.topics["replies"], 21, timeout_s=20, settle_s=1.0)
        dead = read(settings.bootstrap, settings.topics["dead"], 1, timeout_s=20, settle_s=0.5)
        assert member.running, member.tail()
        member.terminate()
        code = member.wait_exit(30)
    assert position == 21 and code == 0, member.tail()
    by_id = {headers_of(m)[protocol.CORRELATION_ID]: m for m in replies}
    assert len(replies) == len(by_id) == 21, "every request answered once"
    big = headers_of(by_id[b"10"])
    assert by_id[b"10"].key() is None and big[protocol.KEY_OMITTED] == b"1000000"
    assert big[protocol.ERROR_CODE] == b"payload_too_large"
    assert all(protocol.ERROR_CODE not in headers_of(m) for name, m in by_id.items() if name != b"10")
    (letter,) = dead
    assert letter.key() is None and headers_of(letter)[protocol.KEY_OMITTED] == b"1000000"


@pytest.mark.timeout(120)
def test_a_static_member_fenced_by_a_newer_instance_exits_with_code_1(fault_settings, broker):
    """Static membership: a second process with the same ``group.instance.id`` takes the member's place, and the
    broker fences the first (FENCED_INSTANCE_ID, a fatal consumer error): it exits 1 instead of serving on as a
    zombie, and the newer instance serves. Apache Kafka only: neither Tansu nor the mock cluster fences a static
    member (tests/unit/consumer/path/test_source.py shows the fatal path with a fake consumer)."""
    if broker.kind != "kafka":
        pytest.skip(f"the {broker.kind} broker never fences a static member: run with KINFERENCE_TEST_BROKER=kafka")
    settings = fault_settings(1, extra=("--kafka-consumer", f"group.instance.id=static-{uuid.uuid4().hex[:8]}"))
    with Group(settings) as group:
        older = group.start("older")
        group.wait_stable(40)
        newer = group.start("newer")
        code = older.wait_exit(60)
        produce(settings.bootstrap, settings.topics["requests"], [(None, orjson.dumps({"seq": 1}), [])])
        deadline = time.monotonic() + 30
        while committed(settings.bootstrap, settings.group_id, [(settings.topics["requests"], 0)]) != {
                (settings.topics["requests"], 0): 1} and time.monotonic() < deadline:
            time.sleep(0.5)
        served = committed(settings.bootstrap, settings.group_id, [(settings.topics["requests"], 0)])
    print(f"\nstatic membership: the fenced instance exited {code}")
    assert code == 1 and "FENCED" in older.tail().upper(), older.tail()
    assert served == {(settings.topics["requests"], 0): 1}, newer.tail()
