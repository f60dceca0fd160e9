"""The ``sim`` handler: the embedding handler's real tokenisation around a simulated device."""

from __future__ import annotations

import multiprocessing
import multiprocessing.synchronize
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kinference.errors import HandlerLoadError
from kinference.handlers import HandlerContext, load_handler
from kinference.handlers.embedding import EmbeddingHandler
from kinference.handlers.sim import DEVICE_FILE, SharedDevice


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


def test_batches_from_several_threads_queue_on_one_device():
    """Two threads (two CUDA streams) share the device: their batches run one after the other, so each call
    waits for its own batch plus the one queued before it, and the device is never busy twice at once."""
    sim = set_up(fixed_ms=50, per_token_us=0)
    inputs = sim.preprocess([sim.validate({"text": "one device"})])
    started = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(sim.inference, [inputs, inputs]))
    took = time.perf_counter() - started
    assert 0.100 <= took < 0.150
    assert sim.stats() == {"busy_s": pytest.approx(0.100), "calls": 2}


@pytest.mark.parametrize("option", [{"fixed_ms": -1}, {"per_token_us": "fast"}, {"per_token_us": True}])
def test_bad_speeds_fail_setup(option):
    with pytest.raises(HandlerLoadError, match="must be a number >= 0"):
        set_up(**option)


def _queue_from_another_process(host_dir: str, seconds: float, queued: multiprocessing.synchronize.Event) -> None:
    device = SharedDevice(Path(host_dir) / DEVICE_FILE)
    device.queue(seconds)
    queued.set()
    device.close()


def test_workers_of_one_host_queue_on_one_shared_device(tmp_path):
    """With --workers N (a host directory), the workers' batches queue on one device, as N CUDA contexts share one
    GPU: work another process queued delays this one's, and the busy time is the host's."""
    sim = load_handler("sim")
    sim.setup(HandlerContext(device="cpu", options={"fixed_ms": 100, "per_token_us": 0}, max_batch_size=8,
                             host_dir=tmp_path))
    inputs = sim.preprocess([sim.validate({"text": "one device per host"})])
    queued = multiprocessing.get_context("spawn").Event()
    other = multiprocessing.get_context("spawn").Process(target=_queue_from_another_process,
                                                         args=(str(tmp_path), 1.0, queued))
    other.start()
    try:
        assert queued.wait(60)  # a second of work is queued on the device (queueing returns at once)
        began = time.perf_counter()
        sim.inference(inputs)
        took = time.perf_counter() - began
    finally:
        other.join(30)
    assert took >= 0.8  # behind the other process's second, then its own 100 ms
    assert sim.stats() == {"busy_s": pytest.approx(1.1), "calls": 2}
    sim.close()
    alone = set_up(fixed_ms=100, per_token_us=0)  # no host directory: a device of its own
    assert alone.stats() == {"busy_s": 0.0, "calls": 0}
