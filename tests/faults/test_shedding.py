"""Deadlines and shedding (issue 4, item 4): queued work past its deadline, or older than
``max_queue_ms`` under overload, is answered with a clear code and never computed; latency of the
work that is computed stays bounded; the service recovers as soon as the burst ends.

The handler (``poison_handlers.SlowEcho``) records every item it computed, so "never computed" is
checked against what the model actually saw.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import orjson
import pytest
from confluent_kafka import Message, Producer

from kinference import protocol
from kinference.consumer.service import Service
from tests.faults.poison_handlers import SlowEcho
from tests.integration.kafka_io import headers_of, produce, read, service_config

pytestmark = [pytest.mark.integration, pytest.mark.faults]

READY_S = 30


@contextmanager
def serving(broker, topics: dict[str, str], handler: SlowEcho, **overrides) -> Iterator[Service]:
    config = service_config(broker.bootstrap_servers, topics, metrics=False, shutdown_grace_s=5.0,
                            rebalance_drain_ms=500, **overrides)
    with Service(config, handler=handler) as service:
        assert service.wait_ready(READY_S)
        yield service


def code_of(reply: Message) -> str:
    headers = headers_of(reply)
    if headers[protocol.STATUS] == b"ok":
        return "ok"
    code = headers[protocol.ERROR_CODE].decode()
    assert orjson.loads(reply.value())["error"]["code"] == code
    return code


def one_each(records: list[Message]) -> dict[bytes, Message]:
    counts = Counter(record.key() for record in records)
    assert all(n == 1 for n in counts.values()), "exactly one reply per request"
    return {record.key(): record for record in records}


def epoch_ms() -> int:
    return int(time.time() * 1000)


def answer_one(service: Service, bootstrap: str, topics: dict[str, str], key: bytes) -> tuple[str, float]:
    """Send one request now; its code and the seconds from sending it to its reply's Kafka timestamp."""
    started, sent_ms = time.monotonic(), epoch_ms()
    produce(bootstrap, topics["requests"], [(key, orjson.dumps({"late": True}), [])])
    while time.monotonic() < started + 20:
        replies = {m.key(): m for m in read(bootstrap, topics["replies"], 1 << 30, timeout_s=0.2)}
        if key in replies:
            return code_of(replies[key]), (replies[key].timestamp()[1] - sent_ms) / 1000
        assert service.healthy, service.health_checks()
    raise AssertionError(f"no reply to {key!r} within 20 s")


def test_requests_whose_deadline_passes_while_queued_get_deadline_exceeded_without_compute(broker):
    """A slow batch holds the only inference slot; requests queued behind it with a deadline 800 ms
    ahead expire in the waiting room and are answered deadline_exceeded, never computed; their
    neighbours with a distant deadline are computed in the next batch."""
    topics = broker.topics(requests=1, replies=1, dead=1)
    handler = SlowEcho()
    with serving(broker, topics, handler, handler_options={"batch_s": 0.0}, max_batch_size=32) as service:
        produce(broker.bootstrap_servers, topics["requests"], [(b"blocker", orjson.dumps({"sleep_s": 2.0}), [])])
        assert handler.record.started.wait(10), "the blocker never reached inference"
        soon, later = str(epoch_ms() + 800).encode(), str(epoch_ms() + 60_000).encode()
        records = []
        for i in range(10):
            records.append((f"short-{i}".encode(), orjson.dumps({"i": i}), [(protocol.DEADLINE_MS, soon)]))
            records.append((f"long-{i}".encode(), orjson.dumps({"i": i}), [(protocol.DEADLINE_MS, later)]))
        produce(broker.bootstrap_servers, topics["requests"], records)
        replies = one_each(read(broker.bootstrap_servers, topics["replies"], 21, timeout_s=30, settle_s=0.5))
        assert service.healthy, service.health_checks()
        code, seconds = answer_one(service, broker.bootstrap_servers, topics, b"after")
        assert code == "ok" and seconds < 2

    assert len(replies) == 21 and code_of(replies[b"blocker"]) == "ok"
    for i in range(10):
        short, long = replies[f"short-{i}".encode()], replies[f"long-{i}".encode()]
        assert code_of(short) == "deadline_exceeded" and code_of(long) == "ok"
        assert protocol.BATCH_SIZE not in headers_of(short), "never batched"
        # It was received while its deadline was still ahead: it expired in the queue, not on arrival.
        received_ms = short.timestamp()[1] - float(headers_of(short)[protocol.SERVICE_MS])
        assert received_ms < int(soon) <= short.timestamp()[1]
        assert headers_of(long)[protocol.BATCH_SIZE] == b"10"
    # The model computed the ten long-deadline requests once each and none of the expired ones.
    assert sorted(item["i"] for item in handler.record.seen() if "i" in item) == list(range(10))


class Watch:
    """Samples ``condition`` every 5 ms on a thread while the ``with`` block runs; ``seen``: ever true."""

    def __init__(self, condition: Callable[[], bool]) -> None:
        self._condition = condition
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watch", daemon=True)
        self.seen = False

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.seen |= bool(self._condition())

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(5)


class Burst:
    """Produce ``count`` requests at ``rate`` per second in 20 ms ticks (key ``b"<seq>"``)."""

    def __init__(self, bootstrap: str, topic: str, count: int, rate: float) -> None:
        self.bootstrap, self.topic, self.count, self.rate = bootstrap, topic, count, rate

    def run(self) -> float:
        producer = Producer({"bootstrap.servers": self.bootstrap, "linger.ms": 2})
        started = time.monotonic()
        for seq in range(self.count):
            due = started + seq / self.rate
            if (wait := due - time.monotonic()) > 0:
                producer.poll(0)
                time.sleep(wait)
            producer.produce(self.topic, orjson.dumps({"seq": seq}), str(seq).encode())
        assert producer.flush(30) == 0
        return time.monotonic() - started


@pytest.mark.parametrize("backlog", ["in-batcher", "in-kafka"])
def test_overload_sheds_the_oldest_work_with_overloaded_and_keeps_latency_bounded(broker, backlog):
    """A burst six times the handler's throughput: 50 ms per batch of 4 (80 requests/s) against
    1500 requests at 500/s, with ``max_queue_ms`` 300. The backlog waits either in the batcher
    (``max_in_flight`` above the burst) or in Kafka (paused partitions: ``max_in_flight`` 32); the age
    counts from the record's Kafka timestamp in both cases."""
    max_queue_ms, count = 300, 1500
    topics = broker.topics(requests=2, replies=1, dead=1)
    flow = {"max_in_flight": 4096} if backlog == "in-batcher" else {"max_in_flight": 128, "max_poll_records": 32}
    handler = SlowEcho()
    with serving(broker, topics, handler, handler_options={"batch_s": 0.05}, max_batch_size=4,
                 max_queue_ms=max_queue_ms, **flow) as service:
        started = time.monotonic()
        with Watch(lambda: service.source.paused) as paused:
            produce_s = Burst(broker.bootstrap_servers, topics["requests"], count, rate=500).run()
            replies = one_each(read(broker.bootstrap_servers, topics["replies"], count, timeout_s=60, settle_s=1.0))
        drained_s = time.monotonic() - started
        assert service.healthy, service.health_checks()
        code, after_s = answer_one(service, broker.bootstrap_servers, topics, b"after")
        requests = {m.key(): m for m in read(broker.bootstrap_servers, topics["requests"], count + 1)}  # + "after"

    assert len(replies) == count, f"{count - len(replies)} requests were never answered"
    assert paused.seen == (backlog == "in-kafka"), "where the backlog waited"
    codes = Counter(code_of(reply) for reply in replies.values())
    assert set(codes) <= {"ok", "overloaded"}, codes
    ok = {key for key, reply in replies.items() if code_of(reply) == "ok"}
    shed = set(replies) - ok
    assert len(shed) >= count // 2, f"a burst 6x capacity must shed most of it: {codes}"
    assert len(ok) >= 30, f"the service must keep computing under overload: {codes}"
    # Shed work never reached the model; computed work was computed once.
    computed = Counter(str(item["seq"]).encode() for item in handler.record.seen() if "seq" in item)
    assert set(computed) == ok and set(computed.values()) == {1}
    for key in shed:
        reply = replies[key]
        assert protocol.BATCH_SIZE not in headers_of(reply)
        assert "max_queue_ms is 300" in orjson.loads(reply.value())["error"]["message"]
    # Age of each answered request, from its Kafka timestamp to its reply's: bounded by max_queue_ms plus
    # one batch (50 ms) and publishing; without shedding the last one would wait count / 80 = ~19 s.
    ages = sorted(replies[key].timestamp()[1] - requests[key].timestamp()[1] for key in ok)
    batch = statistics.mean(int(headers_of(replies[key])[protocol.BATCH_SIZE]) for key in ok)
    summary = (f"{backlog}: {count} sent in {produce_s:.1f} s, all answered in {drained_s:.1f} s; {dict(codes)}; "
               f"ok age p50 {statistics.median(ages):.0f} ms, max {ages[-1]:.0f} ms; mean batch {batch:.2f}; "
               f"a request after the burst answered {code} in {after_s * 1000:.0f} ms")
    print(summary)
    assert ages[-1] <= max_queue_ms + 600, summary
    assert code == "ok" and after_s < 1, summary
