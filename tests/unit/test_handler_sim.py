"""The ``sim`` handler: the embedding handler's real tokenisation around a simulated device."""

from __future__ import annotations

import time

import pytest

from kinference.errors import HandlerLoadError
from kinference.handlers import HandlerContext, load_handler
from kinference.handlers.embedding import EmbeddingHandler


def set_up(**options):
    handler = load_handler("sim")
    handler.setup(HandlerContext(device="cpu", options=options, max_batch_size=8))
    return handler


def test_requests_are_tokenised_as_the_embedding_handler_does_and_the_device_time_is_a_plus_b_tokens():
    sim, real = set_up(fixed_ms=20, per_token_us=1000), EmbeddingHandler()
    real.setup(HandlerContext(device="cpu", max_batch_size=8))
    texts = ["a short query", "a somewhat longer sentence about kafka partitions and batches"]
    items = [sim.validate({"text": text}) for text in texts]
    assert [sim.cost(item) for item in items] == [real.cost(real.validate({"text": text})) for text in texts]
    inputs = sim.preprocess(items)
    padded = inputs.tensors["input_ids"].numel()
    started = time.perf_counter()
    outputs = sim.inference(inputs)
    took = time.perf_counter() - started
    expected = 0.020 + 0.001 * padded
    assert expected <= took < expected + 0.05
    results = sim.postprocess(outputs, items)
    assert [len(result["embedding"]) for result in results] == [384, 384]  # the model's width
    stats = sim.stats()
    assert stats["calls"] == 1 and stats["busy_s"] == pytest.approx(expected)
    assert sim.describe()["simulated"] == "20 ms + 1000 us/token"


@pytest.mark.parametrize("option", [{"fixed_ms": -1}, {"per_token_us": "fast"}, {"per_token_us": True}])
def test_bad_speeds_fail_setup(option):
    with pytest.raises(HandlerLoadError, match="must be a number >= 0"):
        set_up(**option)
