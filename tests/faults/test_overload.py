"""Overload: requests arrive at 3x the service's capacity for 60 s.

The service (a real ``kinference serve`` process) must pause its partitions instead of queueing without
limit, keep its resident memory within the documented bound, never leave the group, and catch up
afterwards with every request answered.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import orjson
import pytest

from tests.conftest import TEST_CONSUMER_PROPERTIES
from tests.integration.kafka_io import committed, produce, read
from tests.integration.test_cli import ServeProcess

pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.slow]

CAPACITY_RPS = 200  # SlowEcho: 20 ms per batch of at most 4
RATE_RPS = 3 * CAPACITY_RPS
LOAD_S = 30  # long enough for the backlog to reach every bound below; catching up takes another minute
MEMORY_BOUND_MB = 150  # docs/guarantees.md: growth of resident memory under overload


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def test_three_times_capacity_for_half_a_minute(broker, unique_id):
    topics = broker.topics(requests=3, replies=1, dead=1)
    group = f"overload-{unique_id}"
    serve = ServeProcess([
        "--bootstrap-servers", broker.bootstrap_servers, "--request-topics", topics["requests"],
        "--reply-topic", topics["replies"], "--dead-letter-topic", topics["dead"], "--group-id", group,
        "--handler", "tests.integration.slow_handler:SlowEcho", "--max-batch-size", "4", "--no-metrics",
        *[arg for key, value in TEST_CONSUMER_PROPERTIES.items() for arg in ("--kafka-consumer", f"{key}={value}")],
    ])
    ends: Counter = Counter()
    samples: list[float] = []
    stop_sampling = threading.Event()

    def sample() -> None:
        while not stop_sampling.wait(0.5):
            samples.append(rss_mb(serve.process.pid))

    try:
        assert serve.assigned.wait(60), serve.log
        baseline = rss_mb(serve.process.pid)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        started = time.monotonic()
        sent = 0
        while (elapsed := time.monotonic() - started) < LOAD_S:
            due = int(elapsed * RATE_RPS) - sent
            if due > 0:
                ends.update(produce(broker.bootstrap_servers, topics["requests"],
                                    [(None, orjson.dumps(sent + i), []) for i in range(due)]).ends)
                sent += due
            time.sleep(0.05)
        load_end = time.monotonic()
        # Catching up takes about (3 - 1) x LOAD_S at capacity.
        deadline = load_end + 3 * LOAD_S
        while committed(broker.bootstrap_servers, group, list(ends)) != dict(ends) and time.monotonic() < deadline:
            time.sleep(2.0)
        caught_up_s = time.monotonic() - load_end
        stop_sampling.set()
        final = committed(broker.bootstrap_servers, group, list(ends))
        assert serve.terminate_and_wait() == 0, serve.log
    finally:
        stop_sampling.set()
        serve.kill()
    replies = read(broker.bootstrap_servers, topics["replies"], sent, timeout_s=60)
    print(f"overload: sent {sent} at {RATE_RPS}/s for {LOAD_S} s, replies {len(replies)}, "
          f"caught up {caught_up_s:.0f} s after the load, RSS baseline {baseline:.0f} MB, "
          f"peak {max(samples):.0f} MB")
    assert final == dict(ends), "not every request was answered and committed"
    assert len({orjson.loads(m.value())["result"] for m in replies}) == sent
    assert max(samples) - baseline < MEMORY_BOUND_MB
    assert serve.log.count("assigned ") == 1 and "revoked" not in serve.log.split("received SIGTERM")[0]
    assert "lost " not in serve.log


LARGE_REQUESTS = 30
LARGE_BYTES = 959_000
BYTE_BUDGET = 48_000_000  # ~2 of the requests below, as the decoder counts them (~20 MB each)


def test_large_requests_in_flight_are_bounded_in_bytes_not_only_in_count(broker, unique_id):
    """Issue 29, item 5 (scaled down from 150 requests): requests of a 959 KB array of two-character strings hold
    ~14 MB each decoded, so a count bound (2,048) let 150 of them take RSS from 61 MB to 2,188 MB. Under
    ``KINFERENCE_MAX_IN_FLIGHT_BYTES`` the partitions pause on bytes: at most a few are decoded at a time, and every
    request is still answered."""
    topics = broker.topics(requests=1, replies=1, dead=1)
    value = b"[" + b",".join([b'"ab"'] * (LARGE_BYTES // 5)) + b"]"
    ends = produce(broker.bootstrap_servers, topics["requests"],
                   [(str(i).encode(), value, []) for i in range(LARGE_REQUESTS)]).ends
    group = f"bytes-{unique_id}"
    serve = ServeProcess([
        "--bootstrap-servers", broker.bootstrap_servers, "--request-topics", topics["requests"],
        "--reply-topic", topics["replies"], "--dead-letter-topic", topics["dead"], "--group-id", group,
        "--handler", "tests.integration.slow_handler:SlowLength", "--max-batch-size", "2", "--no-metrics",
        *[arg for key, value in TEST_CONSUMER_PROPERTIES.items() for arg in ("--kafka-consumer", f"{key}={value}")],
    ], env={"KINFERENCE_MAX_IN_FLIGHT_BYTES": str(BYTE_BUDGET)})
    samples: list[float] = []
    try:
        # The model loads before the group is joined: what RSS grows by after this is what requests hold.
        assert serve.assigned.wait(60), serve.log
        baseline = rss_mb(serve.process.pid)
        deadline = time.monotonic() + 120
        while committed(broker.bootstrap_servers, group, list(ends)) != dict(ends) and time.monotonic() < deadline:
            samples.append(rss_mb(serve.process.pid))
            time.sleep(0.2)
        final = committed(broker.bootstrap_servers, group, list(ends))
        assert serve.terminate_and_wait() == 0, serve.log
    finally:
        serve.kill()
    replies = read(broker.bootstrap_servers, topics["replies"], LARGE_REQUESTS, timeout_s=30)
    growth = max(samples) - baseline
    print(f"byte budget: {LARGE_REQUESTS} x {LARGE_BYTES} B requests, RSS baseline {baseline:.0f} MB, "
          f"peak {max(samples):.0f} MB (+{growth:.0f} MB)")
    assert final == dict(ends), "not every request was answered and committed"
    assert sorted(orjson.loads(m.value())["result"] for m in replies) == [LARGE_BYTES // 5] * LARGE_REQUESTS
    # Unbounded, the 30 held ~420 MB; under the budget, a few at a time (plus the allocator's slack).
    assert growth < 200, f"RSS grew {growth:.0f} MB with a {BYTE_BUDGET / 1e6:.0f} MB byte budget"
