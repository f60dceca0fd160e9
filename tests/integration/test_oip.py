"""Open Inference Protocol (V2) requests through Kafka, sent as MLServer's Kafka clients send them (the value an
InferenceRequest, the model in the ``mlserver-model`` header, the request id as the key), beside kinference's own
JSON requests on the same topic."""

from __future__ import annotations

import orjson
import pytest

from kinference import protocol
from kinference.consumer.service import Service
from kinference.consumer.wire import oip
from tests.integration.kafka_io import headers_of, produce, read, service_config

pytestmark = [pytest.mark.integration, pytest.mark.model]


def inference_request(text: str) -> bytes:
    return orjson.dumps({"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [text]}],
                         "outputs": [{"name": "embedding"}]})


def test_an_mlserver_kafka_client_gets_inference_responses_keyed_by_its_request_ids(broker):
    topics = broker.topics(requests=2, replies=1, dead=1)
    texts = ["kafka streams", "a longer sentence about batching requests", "hi"]
    mlserver = [(oip.MODEL_HEADER, b"minilm"), (oip.VERSION_HEADER, b"v1")]
    records = [(f"req-{i}".encode(), inference_request(text), mlserver) for i, text in enumerate(texts)]
    records += [(f"plain-{i}".encode(), orjson.dumps({"text": text}), []) for i, text in enumerate(texts)]
    records.append((b"elsewhere", inference_request("x"), [(oip.MODEL_HEADER, b"resnet")]))
    records.append((b"no-inputs", b'{"inputs": []}', mlserver))
    config = service_config(broker.bootstrap_servers, topics, handler="embedding", model_name="minilm",
                            model_version="v1", max_batch_size=8)
    with Service(config) as service:
        assert service.wait_ready(30)
        produce(broker.bootstrap_servers, topics["requests"], records)
        replies = {m.key(): m for m in read(broker.bootstrap_servers, topics["replies"], len(records))}
        dead = read(broker.bootstrap_servers, topics["dead"], 2)
    for i in range(len(texts)):
        response = orjson.loads(replies[f"req-{i}".encode()].value())
        assert (response["id"], response["model_name"], response["model_version"]) == (f"req-{i}", "minilm", "v1")
        (output,) = response["outputs"]
        assert (output["name"], output["datatype"], output["shape"]) == ("embedding", "FP32", [1, 384])
        plain = orjson.loads(replies[f"plain-{i}".encode()].value())["result"]["embedding"]
        assert output["data"] == pytest.approx(plain, abs=1e-6)  # the same model, whichever protocol asked
    elsewhere = replies[b"elsewhere"]
    assert headers_of(elsewhere)[protocol.ERROR_CODE] == b"model_not_found"
    assert "resnet" in orjson.loads(elsewhere.value())["error"]
    assert headers_of(replies[b"no-inputs"])[protocol.ERROR_CODE] == b"bad_request"
    assert sorted(m.key() for m in dead) == [b"elsewhere", b"no-inputs"]
