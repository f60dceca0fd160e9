"""The request-reply client against the real service (echo) on the test broker."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from kinference.consumer.service import Service
from kinference.handlers.echo import EchoHandler
from kinference.loadgen import Client, ClientError, ReplyError, RequestTimeout
from tests.conftest import FETCH_PROPERTIES, NO_THREAD_DIES
from tests.integration.kafka_io import service_config

pytestmark = [pytest.mark.integration, NO_THREAD_DIES]


class NapEcho(EchoHandler):
    """Echo that first sleeps ``{"nap": seconds}`` when a request asks for it (for late replies)."""

    def inference(self, inputs: list[Any]) -> list[Any]:
        time.sleep(max((i.get("nap", 0) for i in inputs if isinstance(i, dict)), default=0))
        return inputs


@pytest.fixture(scope="module")
def served(broker):
    """One echo service for the module; ``orphan`` is a request topic nobody serves."""
    topics = broker.topics(requests=3, replies=2, dead=1, orphan=1)
    # Clients may also ask for replies on topics of their own ("shared-...", below).
    config = service_config(broker.bootstrap_servers, topics, metrics=True, metrics_port=0,
                            reply_topics_allowed=["shared-*"])
    with Service(config, handler=NapEcho()) as service:
        assert service.wait_ready(30)
        yield broker.bootstrap_servers, topics


def client(served, topic: str = "requests", reply_topic: str | None = None, **options: Any) -> Client:
    bootstrap, topics = served
    return Client(bootstrap, topics[topic], reply_topic or topics["replies"],
                  **{"timeout_s": 10.0, "reply_consumer": FETCH_PROPERTIES, **options})


def test_requests_from_many_threads_get_their_own_replies(served):
    failures: list[str] = []

    def caller(thread: int, kinference: Client) -> None:
        for i in range(50):
            payload = {"thread": thread, "i": i}
            if kinference.request(payload, key=f"{thread}-{i}").result() != payload:
                failures.append(f"{thread}/{i}")
        futures = [(i, kinference.send({"thread": thread, "f": i})) for i in range(50)]
        failures.extend(f"{thread}/f{i}" for i, f in futures if f.result(10).result() != {"thread": thread, "f": i})

    with client(served) as kinference:
        threads = [threading.Thread(target=caller, args=(t, kinference)) for t in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        stats = kinference.stats()
    assert not failures
    assert (stats.sent, stats.answered, stats.pending, stats.late, stats.duplicates) == (800, 800, 0, 0, 0)


def test_asyncio_requests_resolve_to_the_right_replies_even_beyond_max_pending(served):
    async def many(kinference: Client) -> list:
        return await asyncio.gather(*(kinference.request_async({"n": n}) for n in range(300)))

    with client(served, max_pending=16) as kinference:
        replies = asyncio.run(many(kinference))
        assert [reply.result() for reply in replies] == [{"n": n} for n in range(300)]
        assert kinference.stats().pending == 0


def test_batch_call_keeps_order(served):
    with client(served) as kinference:
        outcomes = kinference.request_many([{"n": n} for n in range(200)])
    assert [o.result() for o in outcomes] == [{"n": n} for n in range(200)]


def test_error_reply_is_a_reply_whose_result_raises(served):
    with client(served) as kinference:
        reply = kinference.request(b"{not json")
    assert not reply.ok and reply.error_code == "bad_request"
    with pytest.raises(ReplyError):
        reply.result()


def test_a_bytearray_or_memoryview_value_is_sent_as_its_bytes(served):
    """The producer takes read-only bytes only: the client hands it their bytes (it raised TypeError)."""
    with client(served) as kinference:
        replies = [kinference.request(value) for value in (bytearray(b'{"n": 1}'), memoryview(b'{"n": 2}'))]
    assert [reply.result() for reply in replies] == [{"n": 1}, {"n": 2}]


def test_timeout_resolves_as_timeout_and_leaves_nothing_pending(served):
    with client(served, "orphan") as kinference:
        started = time.monotonic()
        with pytest.raises(RequestTimeout):
            kinference.request({"x": 1}, timeout_s=0.3)
        assert 0.3 <= time.monotonic() - started < 1.5

        async def one() -> None:
            await kinference.request_async({"x": 2}, timeout_s=0.2)

        with pytest.raises(RequestTimeout):
            asyncio.run(one())
        outcomes = kinference.request_many([1, 2, 3], timeout_s=0.2)
        assert all(isinstance(o, RequestTimeout) for o in outcomes)
        stats = kinference.stats()
    assert (stats.timed_out, stats.pending) == (5, 0)


def test_late_reply_is_counted_and_delivered_to_nobody(served):
    with client(served) as kinference:
        slow = kinference.send({"nap": 0.8}, timeout_s=0.2)
        with pytest.raises(RequestTimeout):
            slow.result(5)
        # Sent while the slow one is still being computed: it must get its own reply, not the late one.
        assert kinference.request({"fast": 1}).result() == {"fast": 1}
        deadline = time.monotonic() + 10
        while kinference.stats().late == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = kinference.stats()
    assert (stats.late, stats.answered, stats.timed_out, stats.pending) == (1, 1, 1, 0)


def test_clients_on_one_partition_share_it_and_a_third_reads_only_its_own(broker, served):
    # A reply topic of their own (the service answers on the topic each request names), empty at start.
    shared = broker.topics(shared=2)["shared"]
    with client(served, reply_topic=shared, reply_partition=0) as a, \
            client(served, reply_topic=shared, reply_partition=0) as b, \
            client(served, reply_topic=shared, reply_partition=1) as c:
        for kinference, name in ((a, "a"), (b, "b"), (c, "c")):
            assert [r.result() for r in kinference.request_many([{name: i} for i in range(30)])] == \
                   [{name: i} for i in range(30)]
        deadline = time.monotonic() + 10
        while (a.stats().unmatched, b.stats().unmatched) < (30, 30) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (a.stats().unmatched, b.stats().unmatched) == (30, 30), "each saw the other's replies"
        assert c.stats().unmatched == 0, "replies went to the partition each client asked for"


def test_replies_already_on_the_partition_are_ignored(served):
    bootstrap, topics = served
    producer = Producer({"bootstrap.servers": bootstrap})
    for i in range(20):
        producer.produce(topics["replies"], b"{}", partition=1,
                         headers=[("kinference-correlation-id", f"old-{i}".encode())])
    assert producer.flush(10) == 0
    with client(served, reply_partition=1) as kinference:
        assert kinference.request({"new": 1}).result() == {"new": 1}
        assert kinference.stats().answered == 1


def test_missing_topic_fails_at_start_and_is_not_created(served):
    bootstrap, topics = served
    with pytest.raises(ClientError, match="does not exist"):
        Client(bootstrap, "no-such-topic-x1", topics["replies"]).start()
    assert "no-such-topic-x1" not in AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10).topics
