"""/metrics, /healthz and /readyz of a running service, scraped over HTTP."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kinference.consumer.service import Service
from tests.integration.kafka_io import committed, produce, read, service_config

pytestmark = pytest.mark.integration


def get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def samples(port: int) -> dict[tuple[str, frozenset], float]:
    status, body = get(port, "/metrics")
    assert status == 200
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }


def value(metrics: dict, name: str, **labels: str) -> float:
    return metrics.get((name, frozenset(labels.items())), 0.0)


def wait_for(predicate, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_metrics_count_what_was_sent_and_readiness_follows_assignment(broker):
    topics = broker.topics(requests=3, replies=1, dead=1)
    topic = topics["requests"]
    config = service_config(broker.bootstrap_servers, topics, metrics_host="127.0.0.1", metrics=True, metrics_port=0,
                            max_batch_size=8)
    valid, malformed = 250, 50
    with Service(config) as service:
        port = service.endpoints.port
        status, body = get(port, "/readyz")  # the group join takes seconds: not assigned yet
        assert status == 503 and orjson.loads(body)["checks"]["group_joined"] is False
        assert value(samples(port), "kinference_ready") == 0  # the alert rules' view of /readyz
        assert get(port, "/healthz")[0] == 200 and value(samples(port), "kinference_healthy") == 1
        assert service.wait_ready(30)
        assert wait_for(lambda: get(port, "/readyz")[0] == 200), get(port, "/readyz")
        assert value(samples(port), "kinference_ready") == 1

        records = [(None, orjson.dumps({"i": i}), []) for i in range(valid)]
        records += [(None, b"{broken", [])] * malformed
        produced = produce(broker.bootstrap_servers, topic, records)
        assert len(read(broker.bootstrap_servers, topics["replies"], valid + malformed)) == valid + malformed
        assert len(read(broker.bootstrap_servers, topics["dead"], malformed)) == malformed

        def lag_is_zero() -> bool:
            metrics = samples(port)
            lags = [value(metrics, "kinference_consumer_lag", topic=topic, partition=str(p)) for _, p in produced.ends]
            measured = [(("kinference_consumer_lag", frozenset({"topic": topic, "partition": str(p)}.items()))
                         in metrics) for _, p in produced.ends]
            return all(measured) and lags == [0.0] * len(lags) and value(metrics, "kinference_in_flight") == 0

        assert wait_for(lag_is_zero), "consumer lag did not drop to 0"
        metrics = samples(port)

    assert value(metrics, "kinference_requests_total", model="echo", topic=topic, outcome="ok") == valid
    assert value(metrics, "kinference_requests_total", model="echo", topic=topic, outcome="bad_request") == malformed
    assert value(metrics, "kinference_replies_total", status="ok") == valid
    assert value(metrics, "kinference_replies_total", status="error") == malformed
    assert value(metrics, "kinference_dead_letters_total") == malformed
    assert value(metrics, "kinference_batch_size_sum", model="echo") == valid  # only valid requests reach a batch
    assert 1 <= value(metrics, "kinference_batch_size_count", model="echo") <= valid
    assert value(metrics, "kinference_queue_wait_seconds_count", model="echo", topic=topic) == valid
    assert value(metrics, "kinference_service_seconds_count", model="echo", topic=topic) == valid + malformed
    assert value(metrics, "kinference_stage_seconds_count", model="echo", stage="inference") == value(
        metrics, "kinference_batch_size_count", model="echo")
    assert value(metrics, "kinference_commits_total") >= 1 and value(metrics, "kinference_commit_failures_total") == 0
    assert value(metrics, "kinference_assigned_partitions") == 3
    assert value(metrics, "kinference_model_info", model="echo", handler="echo") == 1
    assert value(metrics, "kinference_fatal_errors_total", client="consumer") == 0
    assert value(metrics, "process_start_time_seconds") > 0
    # The adaptive policy's cost model is exposed (NaN until enough batches of different sizes ran).
    assert {name for name, _ in metrics if name.startswith("kinference_batch_cost_")} == {
        "kinference_batch_cost_fixed_seconds", "kinference_batch_cost_per_unit_seconds"}


def test_lag_keeps_growing_while_partitions_are_paused_and_matches_the_broker(broker):
    """Lag is end offset minus committed offset, asked of the broker every lag_interval_s (what KEDA computes).
    Before the fix it came from the consumer's cached watermarks, which stop moving exactly while backpressure
    has the partitions paused: with 200 requests waiting it read the handful the member had fetched."""
    topics = broker.topics(requests=1, replies=1, dead=1)
    topic = topics["requests"]
    config = service_config(broker.bootstrap_servers, topics, metrics_host="127.0.0.1", metrics=True, metrics_port=0,
                            handler="tests.faults.handlers:TaggedEcho", handler_options={"delay_s": 0.5},
                            max_batch_size=2, max_in_flight=4, max_poll_records=4)
    with Service(config) as service:
        assert service.wait_ready(30)
        port = service.endpoints.port

        def lag() -> float:
            return value(samples(port), "kinference_consumer_lag", topic=topic, partition="0")

        def send(start: int) -> None:  # one record per batch: Tansu's end offset is right only then (TANSU.md)
            produce(broker.bootstrap_servers, topic, [(None, orjson.dumps({"seq": i}), [])
                                                      for i in range(start, start + 100)], **{"batch.num.messages": 1})

        send(0)
        assert wait_for(lambda: service.source.paused and lag() >= 80), (service.source.paused, lag())
        send(100)  # arrives while the partition is paused: no fetch brings its watermark
        assert wait_for(lambda: lag() >= 180), lag()
        first = lag()
        time.sleep(3.0)  # the member answers 4 requests a second
        later = lag()
        group_committed = committed(broker.bootstrap_servers, config.group_id, [(topic, 0)])[(topic, 0)]
    assert later == pytest.approx(200 - max(0, group_committed), abs=8)  # the broker's own figure, give or take
    assert first - later >= 4, f"lag must fall as requests are answered: {first} -> {later}"


def test_a_member_without_partitions_is_ready_as_a_standby(broker):
    """More members than partitions: the extra member is in the group with nothing to do. It reports ready (a
    standby that takes partitions over when another member leaves), not unready forever."""
    topics = broker.topics(requests=1, replies=1, dead=1)
    config = service_config(broker.bootstrap_servers, topics, metrics_host="127.0.0.1", metrics=True, metrics_port=0)
    with Service(config) as first, Service(config) as second:
        assert first.wait_ready(30) and second.wait_ready(60)
        assert wait_for(lambda: len(first.source.rebalance.partitions) + len(second.source.rebalance.partitions) == 1,
                        30)
        idle = first if not first.source.rebalance.partitions else second
        status, body = get(idle.endpoints.port, "/readyz")
        checks = orjson.loads(body)["checks"]
        assert status == 200 and checks["group_joined"] is True, body
        assert value(samples(idle.endpoints.port), "kinference_assigned_partitions") == 0
