"""The poll loop's intake (issue 11, item 1): every record the consumer hands over is tracked before anything
that can fail, so one record that breaks decoding or a handler hook can neither drop the records after it in
the same ``consume()`` call nor let the commit pass over them.

Each test puts the bad record in the middle of a run of valid ones on one partition, produced before the
service starts, so they all come out of the same ``consume()`` calls. Then every valid record is answered, the
bad one gets what the protocol promises, and the committed offset reaches the end of the partition.
"""

from __future__ import annotations

import orjson
import pytest

from kinference import protocol
from tests.faults.poison_handlers import Poison
from tests.faults.test_poison import by_key, code_of, collect, serving
from tests.integration.kafka_io import committed, headers_of, produce
from tests.raw_producer import produce_raw

pytestmark = [pytest.mark.integration, pytest.mark.faults]

BEFORE, AFTER = 20, 20


def test_a_header_name_that_is_not_utf8_is_dead_lettered_and_its_neighbours_answered(broker):
    """A Java, Go or C client can write such a record (here librdkafka's C API through ctypes,
    tests/raw_producer.py). confluent-kafka's ``Message.headers()`` then raises ``SystemError`` when the bad
    name is the last header, and returns a list that crashes the interpreter when it is not. Before the fix the
    exception left the poll loop: the records after it in the batch were never answered, and the commit passed
    them (and the second kind killed the process)."""
    topics = broker.topics(requests=1, replies=1, dead=1)
    valid = [(f"v{i}".encode(), orjson.dumps({"n": i}), [(protocol.CORRELATION_ID.encode(), f"c{i}".encode())])
             for i in range(BEFORE + AFTER)]
    bad_last = (b"bad-last", orjson.dumps({"n": -1}), [(protocol.CORRELATION_ID.encode(), b"cb"), (b"\xff-x", b"x")])
    bad_first = (b"bad-first", orjson.dumps({"n": -2}), [(b"\xfe-y", b"y"), (protocol.CORRELATION_ID.encode(), b"cc")])
    produce_raw(broker.bootstrap_servers, topics["requests"], 0,
                [*valid[:BEFORE], bad_last, bad_first, *valid[BEFORE:]])
    with serving(broker, topics, Poison(), max_poll_records=500) as service:
        replies = by_key(collect(service, broker.bootstrap_servers, topics["replies"], len(valid), timeout_s=30))
        dead = by_key(collect(service, broker.bootstrap_servers, topics["dead"], 2, timeout_s=15))
        assert service.healthy, service.problems()
    assert set(replies) == {key for key, _, _ in valid}, "every valid record is answered, the bad ones are not"
    assert all(code_of(reply) is None for reply in replies.values())
    # Unroutable (their headers cannot be read): answered by their dead letters only, with raw key and value.
    assert set(dead) == {b"bad-last", b"bad-first"}
    for offset, (key, value, _) in enumerate((bad_last, bad_first), start=BEFORE):
        headers = headers_of(dead[key])
        assert dead[key].value() == value and headers[protocol.ERROR_CODE] == b"bad_request"
        assert b"headers cannot be read" in headers[protocol.ERROR_MESSAGE]
        assert headers[protocol.SOURCE_OFFSET] == str(offset).encode()
    ends = {(topics["requests"], 0): len(valid) + 2}
    assert committed(broker.bootstrap_servers, service.config.group_id, list(ends)) == ends


@pytest.mark.parametrize(("poison", "message"), [("cost_crash", "cost blew up"), ("cost_text", "cost returned '12'")])
def test_a_cost_hook_that_fails_for_one_request_in_a_thousand_fails_that_request_only(broker, poison, message):
    """Before the fix a ``cost`` that returned something other than a token count reached the batcher, whose
    exception left the poll loop with the rest of the batch untracked."""
    topics = broker.topics(requests=1, replies=1, dead=1)
    records = [(f"v{i}".encode(), orjson.dumps({"n": i, **({"poison": poison} if i == 500 else {})}), [])
               for i in range(1000)]
    produced = produce(broker.bootstrap_servers, topics["requests"], records, **{"batch.num.messages": 1000})
    with serving(broker, topics, Poison(), max_poll_records=500, max_batch_tokens=None) as service:
        replies = by_key(collect(service, broker.bootstrap_servers, topics["replies"], 1000, timeout_s=60))
        assert service.healthy, service.problems()
    codes = {key: code_of(reply) for key, reply in replies.items()}
    assert len(codes) == 1000 and codes.pop(b"v500") == "handler_error" and set(codes.values()) == {None}
    assert message in orjson.loads(replies[b"v500"].value())["error"]["message"]
    assert committed(broker.bootstrap_servers, service.config.group_id, list(produced.ends)) == dict(produced.ends)
