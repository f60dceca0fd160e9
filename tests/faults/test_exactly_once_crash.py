"""Exactly-once across SIGKILLs: a read_committed reader sees each request's reply exactly once.

Needs Apache Kafka (``KINFERENCE_TEST_BROKER=kafka``; CI runs it there): Tansu's read_committed does not hide
aborted transactions, so on Tansu the replies of a killed member's open transaction stay visible.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import orjson
import pytest

from kinference import protocol
from tests.conftest import TEST_CONSUMER_PROPERTIES
from tests.integration.kafka_io import committed, headers_of, produce, read
from tests.integration.test_cli import ServeProcess

pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.slow]

TOTAL = 3000
RATE_RPS = 300


def test_sigkill_in_exactly_once_mode_leaves_no_duplicate_committed_reply(broker, unique_id):
    if broker.kind != "kafka":
        pytest.skip("Tansu's read_committed shows aborted transactions: run with KINFERENCE_TEST_BROKER=kafka "
                    "(Apache Kafka from Maven Central; needs a JDK 17+ and Maven)")
    topics = broker.topics(requests=3, replies=1, dead=1)
    group = f"eos-crash-{unique_id}"
    args = ["--bootstrap-servers", broker.bootstrap_servers, "--request-topics", topics["requests"],
            "--reply-topic", topics["replies"], "--dead-letter-topic", topics["dead"], "--group-id", group,
            "--handler", "echo", "--delivery", "exactly-once", "--commit-interval-ms", "200",
            "--no-metrics",
            *[arg for key, value in TEST_CONSUMER_PROPERTIES.items() for arg in ("--kafka-consumer", f"{key}={value}")]]
    ends: Counter = Counter()

    def load() -> None:
        for start in range(0, TOTAL, RATE_RPS // 10):
            batch = range(start, min(start + RATE_RPS // 10, TOTAL))
            ends.update(produce(broker.bootstrap_servers, topics["requests"],
                                [(None, orjson.dumps(i), [(protocol.CORRELATION_ID, str(i).encode())])
                                 for i in batch]).ends)
            time.sleep(0.1)

    members = [ServeProcess(args)]
    try:
        assert members[0].assigned.wait(60), members[0].log
        producer = threading.Thread(target=load)
        producer.start()
        for _ in range(3):
            time.sleep(2.5)
            members[-1].process.kill()  # SIGKILL: its open transaction is left to the broker to abort
            members[-1].process.wait()
            members.append(ServeProcess(args))
            assert members[-1].assigned.wait(60), members[-1].log
        producer.join(120)
        deadline = time.monotonic() + 120
        while committed(broker.bootstrap_servers, group, list(ends)) != dict(ends) and time.monotonic() < deadline:
            time.sleep(1.0)
        assert committed(broker.bootstrap_servers, group, list(ends)) == dict(ends)
        assert members[-1].terminate_and_wait() == 0
    finally:
        for member in members:
            member.kill()
    replies = read(broker.bootstrap_servers, topics["replies"], TOTAL, timeout_s=60, settle_s=2.0,
                   **{"isolation.level": "read_committed"})
    per_request = Counter(headers_of(m)[protocol.CORRELATION_ID] for m in replies)
    assert len(per_request) == TOTAL, f"{TOTAL - len(per_request)} requests have no committed reply"
    duplicates = {cid: n for cid, n in per_request.items() if n > 1}
    assert not duplicates, f"{len(duplicates)} requests have more than one committed reply"
