"""``--delivery exactly-once``: replies and offsets committed in one transaction."""

from __future__ import annotations

import time
from collections import Counter

import orjson
import pytest

from kinference import protocol
from kinference.consumer.service import Service
from tests.integration.kafka_io import committed, headers_of, produce, read, service_config

pytestmark = pytest.mark.integration

READ_COMMITTED = {"isolation.level": "read_committed"}


def test_replies_and_offsets_commit_together(broker):
    topics = broker.topics(requests=3, replies=1, dead=1)
    records = [(str(i).encode(), orjson.dumps(i) if i % 10 else b"{oops", [(protocol.CORRELATION_ID, str(i).encode())])
               for i in range(300)]
    config = service_config(broker.bootstrap_servers, topics, delivery="exactly-once", commit_interval_ms=100)
    with Service(config) as service:
        assert service.wait_ready(30)
        produced = produce(broker.bootstrap_servers, topics["requests"], records)
        replies = read(broker.bootstrap_servers, topics["replies"], 300, settle_s=1.0, **READ_COMMITTED)
        dead = read(broker.bootstrap_servers, topics["dead"], 30, settle_s=0.5, **READ_COMMITTED)
        assert service.metrics.commits._value.get() >= 1
    by_id = Counter(headers_of(m)[protocol.CORRELATION_ID] for m in replies)
    assert len(by_id) == 300 and set(by_id.values()) == {1}
    assert sum(1 for m in replies if headers_of(m)[protocol.STATUS] == b"error") == 30
    assert len(dead) == 30
    # The offsets went with the transactions: everything is committed, and a restart serves nothing.
    assert committed(broker.bootstrap_servers, config.group_id, list(produced.ends)) == dict(produced.ends)
    with Service(config) as service:
        assert service.wait_ready(30)
        time.sleep(1.5)
    assert len(read(broker.bootstrap_servers, topics["replies"], 300, settle_s=1.0, **READ_COMMITTED)) == 300


def test_a_reply_partition_the_topic_lacks_aborts_nothing(broker):
    """Issue 20, defect 3: one client's ``kafka_replyPartition`` naming a partition the reply topic lacks aborted the
    transaction of every reply with it, until the service stopped. It gets ``bad_request`` on the default
    partition, and the other replies commit."""
    topics = broker.topics(requests=1, replies=1, dead=1)
    too_far = [(protocol.SPRING_REPLY_PARTITION, protocol.encode_partition(7))]
    records = [(None, orjson.dumps(i), [(protocol.CORRELATION_ID, str(i).encode()), *(too_far if i % 5 == 0 else [])])
               for i in range(20)]
    config = service_config(broker.bootstrap_servers, topics, delivery="exactly-once", commit_interval_ms=100)
    with Service(config) as service:
        assert service.wait_ready(30)
        produce(broker.bootstrap_servers, topics["requests"], records)
        replies = read(broker.bootstrap_servers, topics["replies"], 20, settle_s=0.5, **READ_COMMITTED)
        aborts = service.metrics.commit_failures._value.get()
        assert service.healthy
    codes = Counter(headers_of(m).get(protocol.ERROR_CODE) for m in replies)
    assert len(replies) == 20 and codes == {None: 16, b"bad_request": 4}
    assert aborts == 0
