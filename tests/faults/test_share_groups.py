"""Share groups (KIP-932, ``--group-type share``) on Apache Kafka: members past the partition count share one
partition with nothing lost, a killed member's records are delivered again, poison is rejected once.

Apache Kafka only (``KINFERENCE_TEST_BROKER=kafka``, as CI runs them): Tansu has no share groups.
"""

from __future__ import annotations

import time
from collections import Counter

import orjson
import pytest

from kinference import protocol
from kinference.consumer.service import Service
from tests.integration.kafka_io import headers_of, produce, read, service_config
from tests.integration.test_cli import ServeProcess

pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.slow]

HANDLER = "tests.faults.handlers:TaggedEcho"


@pytest.fixture
def kafka(broker):
    if broker.kind != "kafka":
        pytest.skip(f"share groups (KIP-932) need Apache Kafka 4.2+ (KINFERENCE_TEST_BROKER=kafka); the {broker.kind} "
                    "broker has none")
    return broker


def share_member(broker, topics: dict[str, str], group: str, *extra: str) -> ServeProcess:
    return ServeProcess(["--bootstrap-servers", broker.bootstrap_servers, "--request-topics", topics["requests"],
                         "--reply-topic", topics["replies"], "--dead-letter-topic", topics["dead"], "--group-id", group,
                         "--group-type", "share", "--handler", HANDLER, "--device", "cpu", "--no-metrics",
                         "--shutdown-grace-s", "10", *extra])


def requests(first: int, count: int) -> list[tuple[None, bytes, list[tuple[str, bytes]]]]:
    return [(None, orjson.dumps({"i": i}), [(protocol.CORRELATION_ID, str(i).encode())])
            for i in range(first, first + count)]


def answers(replies) -> tuple[Counter, Counter]:
    """(replies per correlation id, replies per answering process)."""
    by_id = Counter(headers_of(m)[protocol.CORRELATION_ID].decode() for m in replies)
    by_pid = Counter(orjson.loads(m.value())["result"]["pid"] for m in replies)
    return by_id, by_pid


def share_acknowledgements(service: Service) -> dict[str, int]:
    """The member's acknowledgements so far, by kind (the kinds it has made)."""
    return {sample.labels["kind"]: int(sample.value) for metric in service.metrics.registry.collect()
            for sample in metric.samples if sample.name == "kinference_share_acknowledgements_total" and sample.value}


def wait_serving(members: list[ServeProcess], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(any("serving " in line for line in m.lines) for m in members):
        assert time.monotonic() < deadline, "\n".join(m.log[-2000:] for m in members)
        time.sleep(0.2)


def test_members_past_the_partition_count_share_one_partition_and_lose_nothing(kafka, unique_id):
    """Three members on a one-partition topic: a consumer group would leave two idle; a share group spreads the
    records over all three. Every request is answered once."""
    topics = kafka.topics(requests=1, replies=1, dead=1)
    # 20 ms per batch of at most 8: one member answers ~400 requests/s, below the rate sent.
    members = [share_member(kafka, topics, f"share-{unique_id}", "--handler-options", "delay_s=0.02",
                            "--max-batch-size", "8") for _ in range(3)]
    total = 1500
    try:
        wait_serving(members)
        for start in range(0, total, 100):
            produce(kafka.bootstrap_servers, topics["requests"], requests(start, 100))
            time.sleep(0.1)
        replies = read(kafka.bootstrap_servers, topics["replies"], total, timeout_s=90, settle_s=2.0)
        assert all(m.terminate_and_wait(30) == 0 for m in members), [m.log[-2000:] for m in members]
    finally:
        for member in members:
            member.kill()
    by_id, by_pid = answers(replies)
    print(f"\nshare group, 3 members on 1 partition: {len(by_id)} of {total} answered, replies per member "
          f"{sorted(by_pid.values())}")
    assert set(by_id) == {str(i) for i in range(total)}, f"lost: {total - len(by_id)}"
    assert set(by_id.values()) == {1}, f"answered twice: {[k for k, n in by_id.items() if n > 1][:20]}"
    assert len(by_pid) >= 2, f"one member answered everything: {by_pid}"


def test_a_killed_members_records_are_delivered_again(kafka, unique_id):
    """A member SIGKILLed with records acquired and unanswered: the broker gives them to the other member once
    the dead one's session ends (6 s on the test broker), and every request is answered."""
    topics = kafka.topics(requests=1, replies=1, dead=1)
    group = f"share-kill-{unique_id}"
    slow = ("--handler-options", "delay_s=0.2", "--max-batch-size", "4")
    doomed = share_member(kafka, topics, group, *slow)
    survivor: ServeProcess | None = None
    total = 200
    try:
        wait_serving([doomed])
        produce(kafka.bootstrap_servers, topics["requests"], requests(0, total))
        # ~20 requests/s: the first fetch (all 200 records) is far from answered when the kill comes.
        read(kafka.bootstrap_servers, topics["replies"], 8, timeout_s=30)
        doomed.process.kill()
        doomed.process.wait()
        killed = time.monotonic()
        survivor = share_member(kafka, topics, group, "--max-batch-size", "32")
        replies = read(kafka.bootstrap_servers, topics["replies"], total, timeout_s=90, settle_s=1.0)
        recovered_s = time.monotonic() - killed
        assert survivor.terminate_and_wait(30) == 0, survivor.log[-2000:]
    finally:
        doomed.kill()
        if survivor is not None:
            survivor.kill()
    by_id, by_pid = answers(replies)
    first = by_pid.get(doomed.process.pid, 0)
    print(f"\nshare group, member killed: {first} answered before the kill, {len(by_id)} of {total} answered in all, "
          f"the rest delivered again within {recovered_s:.1f} s")
    assert set(by_id) == {str(i) for i in range(total)}, f"lost: {total - len(by_id)}"
    assert 0 < first < total and survivor.process.pid in by_pid


@pytest.mark.parametrize(("key", "value"), [(None, b"{not json"), (b"k" * 1_000_000, b'{"i": -1}')],
                         ids=["unreadable", "1-MB-key"])
def test_a_poison_record_is_rejected_once_with_a_dead_letter_and_never_delivered_again(kafka, unique_id, key, value):
    """An unreadable record gets one error reply and one dead letter, and is acknowledged REJECT: a member of the
    same share group started afterwards does not get it again, while a released record would come back. So does a
    record with a 1 MB key (issue 29, item 2), which no answer could carry: it stopped each member it reached, and
    after 5 deliveries the broker archived it, with no reply and no dead letter."""
    topics = kafka.topics(requests=1, replies=1, dead=1)
    config = service_config(kafka.bootstrap_servers, topics, group_id=f"share-poison-{unique_id}",
                            group_type="share", kafka_consumer={})
    produce(kafka.bootstrap_servers, topics["requests"],
            [*requests(0, 20), (key, value, [(protocol.CORRELATION_ID, b"poison")])],
            **{"message.max.bytes": "1100000"})
    with Service(config) as first:
        assert first.wait_ready(30)
        replies = read(kafka.bootstrap_servers, topics["replies"], 21, timeout_s=30)
        # A reply can be read before its producer has the broker's acknowledgement, and the record is acknowledged
        # ACCEPT only after that, on the poll thread's next turn (a CI run read all 21 replies with no ACCEPT yet).
        deadline = time.monotonic() + 10
        while (kinds := share_acknowledgements(first)) != {"accept": 20, "reject": 1}:
            assert time.monotonic() < deadline, f"acknowledged {kinds}, not 20 ACCEPT and 1 REJECT"
            time.sleep(0.1)
    with Service(config) as second:
        assert second.wait_ready(30)
        produce(kafka.bootstrap_servers, topics["requests"], requests(20, 1))
        replies = read(kafka.bootstrap_servers, topics["replies"], 23, timeout_s=10)
    by_id = Counter(headers_of(m)[protocol.CORRELATION_ID].decode() for m in replies)
    assert by_id["poison"] == 1 and len(by_id) == 22 and set(by_id.values()) == {1}, by_id
    assert len(read(kafka.bootstrap_servers, topics["dead"], 2, timeout_s=3)) == 1
