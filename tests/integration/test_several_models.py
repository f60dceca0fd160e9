"""Several models in one process, through a real broker: records routed by topic and by the kinference-model
header, each model with its own batcher, replies naming the model that served them, an unknown model answered
with model_not_found, and the metrics labelled by model."""

from __future__ import annotations

import orjson
import pytest

from kinference import protocol
from kinference.consumer.config import ServiceConfig
from kinference.consumer.service import Service
from tests.integration.kafka_io import headers_of, produce, read, service_config

pytestmark = pytest.mark.integration


def test_each_record_is_served_by_its_model_and_the_reply_says_which(broker):
    topics = broker.topics(requests=2, tagged=1, replies=1, dead=1)
    single = service_config(broker.bootstrap_servers, topics).model_dump(exclude_unset=True, exclude={"handler"})
    config = ServiceConfig(**{**single, "request_topics": [topics["requests"], topics["tagged"]], "models": [
        {"name": "echo", "version": "1", "handler": "echo", "max_batch_size": 1},
        {"name": "tagged", "handler": "tests.faults.handlers:TaggedEcho", "request_topics": [topics["tagged"]],
         "max_batch_size": 16, "micro_batch_size": 4, "parallelism": {"preprocess": 2}},
    ]})
    by_topic = [(f"plain-{i}".encode(), orjson.dumps({"n": i}), []) for i in range(6)]
    tagged = [(f"tagged-{i}".encode(), orjson.dumps({"n": i}), []) for i in range(6)]
    named = [(b"named-tagged", b'{"n": 100}', [(protocol.MODEL, b"tagged")])]
    to_echo = [(b"named-echo", b'{"n": 101}', [(protocol.MODEL, b"echo"), (protocol.MODEL_VERSION, b"1")])]
    unknown = [(b"unknown", b'{"n": 102}', [(protocol.MODEL, b"gpt")]),
               (b"old-version", b'{"n": 103}', [(protocol.MODEL, b"echo"), (protocol.MODEL_VERSION, b"0")])]
    with Service(config) as service:
        assert service.wait_ready(30)
        assert [model.name for model in service.models.loaded] == ["echo", "tagged"]
        produce(broker.bootstrap_servers, topics["requests"], by_topic + named + unknown)
        produce(broker.bootstrap_servers, topics["tagged"], tagged + to_echo)
        replies = {m.key(): m for m in read(broker.bootstrap_servers, topics["replies"], 16)}
        dead = read(broker.bootstrap_servers, topics["dead"], 2)
        sample = service.metrics.registry.get_sample_value
        counts = {(model, topic): sample("kinference_requests_total", {"model": model, "topic": topics[topic],
                                                                      "outcome": outcome})
                  for model, topic, outcome in [("echo", "requests", "ok"), ("echo", "tagged", "ok"),
                                                ("tagged", "tagged", "ok"), ("tagged", "requests", "ok"),
                                                ("none", "requests", "model_not_found")]}
        infos = {model: sample("kinference_model_info", {"model": model, "handler": handler})
                 for model, handler in [("echo", "echo"), ("tagged", "tagged-echo")]}
        batches = {model: sample("kinference_batch_size_count", {"model": model}) for model in ("echo", "tagged")}
    assert len(replies) == 16

    def served_by(key: bytes) -> tuple[bytes | None, bytes | None, object]:
        message = replies[key]
        headers = headers_of(message)
        return headers.get(protocol.MODEL), headers.get(protocol.MODEL_VERSION), orjson.loads(message.value())

    for i in range(6):
        model, version, reply = served_by(f"plain-{i}".encode())  # an unmapped topic: the first model
        assert (model, version, reply["result"]) == (b"echo", b"1", {"n": i})
        assert headers_of(replies[f"plain-{i}".encode()])[protocol.BATCH_SIZE] == b"1"  # its own max_batch_size
        model, version, reply = served_by(f"tagged-{i}".encode())  # the topic's model: TaggedEcho's result
        assert (model, version, reply["result"]["value"]) == (b"tagged", None, {"n": i})
    assert served_by(b"named-tagged")[0] == b"tagged" and served_by(b"named-tagged")[2]["result"]["value"] == {
        "n": 100}  # the header wins over the topic
    assert served_by(b"named-echo")[:3] == (b"echo", b"1", {"result": {"n": 101}})
    for key, fragment in [(b"unknown", "'gpt' is not served here"), (b"old-version", "version '0'")]:
        headers = headers_of(replies[key])
        assert headers[protocol.ERROR_CODE] == b"model_not_found" and protocol.MODEL not in headers
        assert fragment in orjson.loads(replies[key].value())["error"]["message"]
    assert sorted(m.key() for m in dead) == [b"old-version", b"unknown"]
    assert counts == {("echo", "requests"): 6, ("echo", "tagged"): 1, ("tagged", "tagged"): 6,
                      ("tagged", "requests"): 1, ("none", "requests"): 2}
    assert infos == {"echo": 1, "tagged": 1}
    assert batches["echo"] == 7 and 1 <= batches["tagged"] <= 7  # a batch split in micro-batches counts once
