"""Misbehaving handlers through a real broker (issue 20): one model that hangs never holds up another model's
requests, is answered with ``handler_timeout`` at the timeout, and turns ``/healthz`` 503 naming it. Wide values
never stall the poll thread for the requests behind them, in one process and with ``--device-process on --workers
2`` (issue 36, item 4: the neighbour's model then runs in the device process)."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator

import orjson
import pytest
from confluent_kafka import Message

from kinference import Client, protocol
from kinference.consumer.config import ServiceConfig
from kinference.consumer.service import Service
from tests.conftest import FETCH_PROPERTIES
from tests.faults.test_device_process import supervised
from tests.faults.test_workers import get as get_status
from tests.integration.kafka_io import headers_of, produce, read, service_config
from tests.integration.test_metrics import get

pytestmark = [pytest.mark.integration, pytest.mark.faults]

HANDLER_TIMEOUT_S = 2.0
STALL_S = 20.0


def replies_to(bootstrap: str, topic: str, keys: set[bytes], timeout_s: float = 30.0) -> dict[bytes, Message]:
    """Every reply on ``topic`` once those to ``keys`` are among them (others come and go meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while True:
        replies = {m.key(): m for m in read(bootstrap, topic, 10**6, timeout_s=1.0)}
        if keys <= replies.keys() or time.monotonic() > deadline:
            return replies


@pytest.mark.timeout(90)
def test_a_hung_model_is_answered_at_the_timeout_and_never_holds_up_another_model(broker):
    """Issue 20, defect 7. Before: model ``a`` hung in inference, its requests reached --max-in-flight, every
    partition paused, and model ``b``'s requests went unanswered while ``/healthz`` stayed 200.

    One partition, shared by both models: ``a``'s stuck request, then more for ``a`` than max_in_flight (64; a's
    share is 32), then 20 for ``b``, in that order."""
    topics = broker.topics(requests=1, replies=1, dead=1)
    single = service_config(broker.bootstrap_servers, topics).model_dump(exclude_unset=True, exclude={"handler"})
    config = ServiceConfig(**{**single, "max_in_flight": 64, "max_batch_size": 4, "metrics": True,
                              "metrics_port": 0, "shutdown_grace_s": 3.0, "models": [
                                  {"name": "a", "handler": "tests.faults.handlers:TaggedEcho",
                                   "handler_timeout_s": HANDLER_TIMEOUT_S, "max_batch_size": 1},
                                  {"name": "b", "handler": "echo"}]})
    to_a = [(b"stuck", orjson.dumps({"stall_s": STALL_S}), [(protocol.MODEL, b"a")])]
    to_a += [(f"a-{i}".encode(), orjson.dumps({"n": i}), [(protocol.MODEL, b"a")]) for i in range(100)]
    to_b = [(f"b-{i}".encode(), orjson.dumps({"n": i}), [(protocol.MODEL, b"b")]) for i in range(20)]
    with Service(config) as service:
        assert service.wait_ready(30)
        assert service.healthy
        started = time.monotonic()
        produce(broker.bootstrap_servers, topics["requests"], to_a)
        time.sleep(0.5)  # the stuck call has started
        produce(broker.bootstrap_servers, topics["requests"], to_b)
        replies = replies_to(broker.bootstrap_servers, topics["replies"], {b"stuck"} | {key for key, _, _ in to_b})
        answered_s = time.monotonic() - started
        status, body = get(service.endpoints.port, "/healthz")
        dead = read(broker.bootstrap_servers, topics["dead"], 1, timeout_s=10)
        problems = service.problems()

    def code(key: bytes) -> bytes | None:
        return headers_of(replies[key]).get(protocol.ERROR_CODE)

    # b's requests were all served, long before a's call would have returned.
    assert all(orjson.loads(replies[f"b-{i}".encode()].value()) == {"result": {"n": i}} for i in range(20)), sorted(
        replies)
    assert answered_s < STALL_S - 5, answered_s
    # The stuck request got handler_timeout, a reply and a dead letter naming it ...
    assert code(b"stuck") == b"handler_timeout"
    assert "inference of model 'a'" in orjson.loads(replies[b"stuck"].value())["error"]["message"]
    assert [(m.key(), headers_of(m)[protocol.ERROR_CODE]) for m in dead] == [(b"stuck", b"handler_timeout")]
    # ... a's requests beyond its share were answered at once (overloaded), none of them computed meanwhile,
    saturated = [key for key in replies if key.startswith(b"a-")]
    assert saturated and all(code(key) == b"overloaded" for key in saturated)
    assert "model 'a' is saturated" in orjson.loads(replies[saturated[0]].value())["error"]["message"]
    # ... and the model is unhealthy: /healthz 503, naming it.
    assert status == 503 and orjson.loads(body)["checks"] == {"source": True, "publisher": True, "model a": False,
                                                                "model b": True}
    assert any("model 'a'" in problem for problem in problems)


WIDE_VALUES = 3


def neighbour_latencies(client: Client, count: int) -> list[float]:
    """Seconds each of ``count`` small requests to model ``b``, sent one after the other, took to be answered (its
    echo, or ``DeviceEcho``'s ``{"value": <echo>, ...}``)."""
    latencies = []
    for i in range(count):
        started = time.monotonic()
        result = client.request({"n": i}, headers=[(protocol.MODEL, b"b")]).result()
        assert {"n": i} in (result, result.get("value")), result
        latencies.append(time.monotonic() - started)
    return latencies


WIDE_MODELS = [{"name": "a", "handler": "tests.integration.slow_handler:SlowLength"}, {"name": "b", "handler": "echo"}]
"""Model a answers with the length of each value: what its stage threads do with a wide value stays small, so what
b's requests share with a's is the poll thread's work alone."""


@contextlib.contextmanager
def serving_wide(broker, fault_settings, path: str) -> Iterator[tuple[str, dict[str, str], Callable[[], bool]]]:
    """The two models of ``WIDE_MODELS``, on one request partition: in this process (``Service``), or in
    ``kinference serve --device-process on --workers 2`` with model b run by the device process (``DeviceEcho``).
    Yields the bootstrap servers, the topics and whether the service is healthy."""
    if path == "in-process":
        topics = broker.topics(requests=1, replies=1, dead=1)
        single = service_config(broker.bootstrap_servers, topics).model_dump(exclude_unset=True, exclude={"handler"})
        with Service(ServiceConfig(**{**single, "models": WIDE_MODELS})) as service:
            assert service.wait_ready(30)
            yield broker.bootstrap_servers, topics, lambda: service.healthy
        return
    models = [WIDE_MODELS[0], {"name": "b", "handler": "tests.faults.handlers:DeviceEcho"}]
    settings = fault_settings(partitions=1, extra=("--models", orjson.dumps(models).decode()))
    with supervised(settings, None) as (_supervisor, port):
        yield settings.bootstrap, settings.topics, lambda: get_status(port, "/healthz")[0] == 200


@pytest.mark.timeout(180)
@pytest.mark.parametrize("path", ["in-process", "device-process"])
def test_wide_values_do_not_stall_the_poll_thread_for_the_requests_behind_them(broker, fault_settings, path):
    """Issue 29, item 4: a 960 KB ``[[],[],...]`` cost ~1.9 s of the poll thread (the parse with the garbage collector
    running over and over, then a Python walk of its 320,000 lists), and 20 of them took a neighbour's p50 from
    14 ms to 19.8 s. Here, the wide values go to model ``a`` and the neighbour's requests, right behind them in the
    same partition, to model ``b``: what they share is the poll thread, and they wait less than a second longer
    than without the wide values."""
    wide = b"[" + b",".join([b"[]"] * (959_000 // 3)) + b"]"
    to_a = [(f"wide-{i}".encode(), wide, [(protocol.MODEL, b"a")]) for i in range(WIDE_VALUES)]
    with (serving_wide(broker, fault_settings, path) as (bootstrap, topics, healthy),
          Client(bootstrap, topics["requests"], topics["replies"], timeout_s=60,
                 reply_consumer=FETCH_PROPERTIES) as client):
        neighbour_latencies(client, 3)  # warm: connections, the first batch
        before = statistics.median(neighbour_latencies(client, 10))
        produce(bootstrap, topics["requests"], to_a)
        behind = neighbour_latencies(client, 10)
        replies = replies_to(bootstrap, topics["replies"], {key for key, _, _ in to_a}, timeout_s=60)
        assert healthy()
    print(f"{path} neighbour: p50 {before * 1000:.0f} ms alone, first {behind[0] * 1000:.0f} ms and p50 "
          f"{statistics.median(behind) * 1000:.0f} ms behind {WIDE_VALUES} wide values")
    assert all(orjson.loads(replies[key].value()) == {"result": 959_000 // 3} for key, _, _ in to_a)
    assert max(behind) < before + 1.0, f"behind {WIDE_VALUES} wide values: {behind} (alone: p50 {before:.3f} s)"
