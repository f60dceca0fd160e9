"""/metrics, /healthz and /readyz of a running service, scraped over HTTP."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kinference.consumer.service import Service
from tests.integration.kafka_io import produce, read, service_config

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
        assert get(port, "/healthz")[0] == 200
        assert service.wait_ready(30)
        assert wait_for(lambda: get(port, "/readyz")[0] == 200), get(port, "/readyz")

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

    assert value(metrics, "kinference_requests_total", topic=topic, outcome="ok") == valid
    assert value(metrics, "kinference_requests_total", topic=topic, outcome="bad_request") == malformed
    assert value(metrics, "kinference_replies_total", status="ok") == valid
    assert value(metrics, "kinference_replies_total", status="error") == malformed
    assert value(metrics, "kinference_dead_letters_total") == malformed
    assert value(metrics, "kinference_batch_size_sum") == valid  # only valid requests reach a batch
    assert 1 <= value(metrics, "kinference_batch_size_count") <= valid
    assert value(metrics, "kinference_queue_wait_seconds_count", topic=topic) == valid
    assert value(metrics, "kinference_service_seconds_count", topic=topic) == valid + malformed
    assert value(metrics, "kinference_stage_seconds_count", stage="inference") == value(
        metrics, "kinference_batch_size_count")
    assert value(metrics, "kinference_commits_total") >= 1 and value(metrics, "kinference_commit_failures_total") == 0
    assert value(metrics, "kinference_assigned_partitions") == 3
    assert value(metrics, "kinference_model_info", handler="echo") == 1
    # The adaptive policy's cost model is exposed (NaN until enough batches of different sizes ran).
    assert {name for name, _ in metrics if name.startswith("kinference_batch_cost_")} == {
        "kinference_batch_cost_fixed_seconds", "kinference_batch_cost_per_unit_seconds"}
