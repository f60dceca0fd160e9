"""The built-in model handlers served end to end through Kafka."""

from __future__ import annotations

import base64

import orjson
import pytest
import torch

from kinference import protocol
from kinference.consumer.service import Service
from tests.integration.kafka_io import headers_of, produce, read, service_config
from tests.models import (
    TINY_LABELS,
    build_tiny_classifier,
    build_tiny_image_classifier,
    make_picture,
    reference_embeddings,
    reference_image_scores,
    varied_texts,
)

pytestmark = [pytest.mark.integration, pytest.mark.model]


@pytest.mark.parametrize("batching", [
    {},  # the defaults: adaptive, token budget, length groups
    {"batch_policy": "adaptive", "max_batch_tokens": 2048},
    {"max_batch_tokens": None},  # first-in-first-out
], ids=["default", "adaptive-2048-tokens", "fifo"])
def test_service_embeddings_equal_transformers_one_text_at_a_time(broker, batching):
    """Whatever the batching, each reply is its own text's embedding: no padding or neighbour leaks in."""
    topics = broker.topics(requests=3, replies=1, dead=1)
    texts = varied_texts(200)
    records = [(str(i).encode(), orjson.dumps({"text": text}), [(protocol.CORRELATION_ID, str(i).encode())])
               for i, text in enumerate(texts)]
    config = service_config(broker.bootstrap_servers, topics, handler="embedding", max_batch_size=32,
                            micro_batch_size=8, parallelism={"preprocess": 2, "inference": 1, "postprocess": 1},
                            **batching)
    with Service(config) as service:
        assert service.wait_ready(30)
        produce(broker.bootstrap_servers, topics["requests"], records)
        replies = read(broker.bootstrap_servers, topics["replies"], len(texts), timeout_s=120)
        padded = service.metrics.registry.get_sample_value
        if config.batching.max_batch_tokens is not None:  # no micro-batch went over the budget
            budget_bucket = min(b for b in (2048.0, 8192.0) if b >= config.batching.max_batch_tokens)
            model = {"model": service.models.loaded[0].name}
            assert padded("kinference_batch_padded_tokens_bucket", {**model, "le": str(budget_bucket)}) == padded(
                "kinference_batch_padded_tokens_count", model)
    assert len(replies) == len(texts)
    by_index = {int(headers_of(m)[protocol.CORRELATION_ID]): orjson.loads(m.value()) for m in replies}
    served = torch.tensor([by_index[i]["result"]["embedding"] for i in range(len(texts))])
    assert max(int(headers_of(m)[protocol.BATCH_SIZE]) for m in replies) > 1, "requests should share batches"
    max_diff = (served - reference_embeddings(texts)).abs().max().item()
    assert max_diff <= 1e-4, f"max abs diff {max_diff:.2e}"


def test_text_classification_with_a_tiny_local_model(broker, tmp_path):
    topics = broker.topics(requests=1, replies=1, dead=1)
    model_dir = build_tiny_classifier(tmp_path / "tiny")
    texts = ["great product", "terrible service, never again", "it is fine", "ok"]
    records = [(str(i).encode(), orjson.dumps({"text": t}), []) for i, t in enumerate(texts)]
    records.append((b"bad", orjson.dumps({"txt": "typo"}), []))
    config = service_config(broker.bootstrap_servers, topics, handler="text-classification", model=model_dir,
                            handler_options={"top_k": 2})
    with Service(config) as service:
        assert service.wait_ready(30)
        produce(broker.bootstrap_servers, topics["requests"], records)
        replies = {m.key(): orjson.loads(m.value()) for m in read(broker.bootstrap_servers, topics["replies"], 5)}
    assert replies[b"bad"]["error"]["code"] == "bad_request"
    for i in range(len(texts)):
        labels = replies[str(i).encode()]["result"]["labels"]
        assert len(labels) == 2 and {entry["label"] for entry in labels} <= set(TINY_LABELS.values())
        assert labels[0]["score"] >= labels[1]["score"] and 0 < labels[1]["score"] < 1


def test_image_classification_of_raw_and_base64_images_with_a_truncated_one_among_them(broker, tmp_path):
    """Raw JPEG, PNG and WebP values and a JSON base64 one, in batches decoded by two preprocess threads; a
    truncated JPEG gets bad_request alone, a GIF is refused at admission. Scores equal the model by hand."""
    topics = broker.topics(requests=1, replies=1, dead=1)
    model_dir = build_tiny_image_classifier(tmp_path / "tiny-image")
    images = {f"{fmt}-{i}": make_picture(320 + 160 * i, 240 + 90 * i, fmt, seed=i)
              for i in range(4) for fmt in ("JPEG", "PNG", "WEBP")}
    truncated = make_picture(1024, 768, seed=9)
    records = [(key.encode(), data, []) for key, data in images.items()]
    records += [(b"base64", orjson.dumps({"image": base64.b64encode(images["JPEG-1"]).decode()}), []),
                (b"truncated", truncated[: len(truncated) // 3], []), (b"gif", make_picture(64, 64, "GIF"), [])]
    config = service_config(broker.bootstrap_servers, topics, handler="image-classification", model=model_dir,
                            handler_options={"fast_jpeg": False}, max_batch_size=8,
                            parallelism={"preprocess": 2, "inference": 1, "postprocess": 1})
    with Service(config) as service:
        assert service.wait_ready(30)
        produce(broker.bootstrap_servers, topics["requests"], records)
        replies = {m.key(): orjson.loads(m.value()) for m in read(broker.bootstrap_servers, topics["replies"],
                                                                    len(records), timeout_s=60)}
    assert replies[b"truncated"]["error"]["code"] == "bad_request"
    assert "cannot be decoded" in replies[b"truncated"]["error"]["message"]
    assert replies[b"gif"]["error"]["code"] == "bad_request"
    assert replies[b"base64"] == replies[b"JPEG-1"]
    for key, data in images.items():
        served = {entry["label"]: entry["score"] for entry in replies[key.encode()]["result"]["labels"]}
        assert served == pytest.approx(reference_image_scores(model_dir, data), abs=1e-5)
