"""The CUDA part of the GPU defaults, run only where torch sees a GPU (skipped here, on CPU-only machines and CI):
float16/bfloat16 weights chosen by ``dtype=auto``, a CUDA graph per shape bucket, and the device process's merged
batches, against the same model in float32 on the CPU. What does not need a GPU is tested in
consumer/accelerator/test_device_server.py and test_accelerate.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kinference.handlers import HandlerContext
from kinference.handlers.accelerate import CudaGraphs, agreement
from kinference.handlers.embedding import EmbeddingHandler
from tests.models import varied_texts

pytestmark = [pytest.mark.model, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _handler(device: str, role: str, **options: object) -> EmbeddingHandler:
    handler = EmbeddingHandler()
    handler.setup(HandlerContext(device=device, options=dict(options), max_batch_size=64, role=role))
    return handler


@pytest.fixture(scope="module")
def cpu() -> EmbeddingHandler:
    return _handler("cpu", "process")


def test_the_device_defaults_on_cuda_agree_with_float32_on_the_cpu(cpu: EmbeddingHandler, tmp_path: Path) -> None:
    gpu = _handler("cuda", "device")
    host = _handler("cpu", "host")
    assert gpu.dtype in (torch.float16, torch.bfloat16)  # dtype=auto took a reduced precision
    assert isinstance(gpu._forward, CudaGraphs) and gpu.accelerator.buckets is not None
    gpu.warm_up()  # captures every bucket shape
    assert not gpu._forward.capturing
    assert sum(graph is not None for graph in gpu._forward._graphs.values()) == len(gpu.accelerator.buckets.all())
    texts = varied_texts(50, max_words=60)
    parts = [texts[:7], texts[7:8], texts[8:33], texts[33:]]
    batches = [host.preprocess(host.validate_many([{"text": text} for text in part])) for part in parts]
    merged = gpu.inference(gpu.merge(batches))
    expected = cpu.inference(cpu.preprocess(cpu.validate_many([{"text": text} for text in texts])))
    assert merged.shape == expected.shape
    assert agreement(expected, merged) >= 0.999
    # Replayed again: the same rows (the graphs' static tensors are refilled each time).
    again = gpu.inference(gpu.merge(batches))
    torch.testing.assert_close(again, merged)
