"""The in-process ceilings: a handler called directly in a loop, with no Kafka, as fast as it goes; and below it
the model alone (``measure_plain_model``), on inputs tokenised and on the device beforehand.

``kinference bench``, ``kinference drain`` and ``kinference bench gpu`` set kinference's throughput beside them.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from kinference.handlers import Handler
from kinference.loadgen.report import percentiles

CUT = {"truncate": True}
"""The embedding handler's option that cuts the corpus's few texts past the model's limit (the ``mixed`` corpus's
longest), as the benchmarks always measured them, instead of refusing them with ``input_too_long``."""

def measure_ceiling(handler: Handler, payloads: Sequence[dict[str, str]], order: Literal["fifo", "grouped"],
                    batch_sizes: Sequence[int], seconds: float) -> dict[str, Any]:
    """Items per second of ``handler`` called directly (``handle``) at each batch size for about ``seconds``,
    batching ``payloads`` in their order or sorted by text length; and the latency of one-item calls (with
    batch size 1 among ``batch_sizes``)."""
    ordered = sorted(payloads, key=lambda payload: len(payload["text"])) if order == "grouped" else list(payloads)
    rates: dict[str, float] = {}
    single_ms: list[float] = []
    for size in batch_sizes:
        batches = [ordered[i:i + size] for i in range(0, len(ordered), size)]
        handle(handler, batches[0])  # warm this shape
        done, began = 0, time.monotonic()
        deadline = began + seconds
        for index in itertools.count():
            batch = batches[index % len(batches)]
            start = time.monotonic()
            handle(handler, batch)
            now = time.monotonic()
            done += len(batch)
            if size == 1:
                single_ms.append((now - start) * 1000)
            if now >= deadline:
                break
        rates[str(size)] = round(done / (time.monotonic() - began), 2)
    best = max(rates, key=rates.__getitem__)
    return {"items_per_s": rates, "best_batch_size": int(best), "best_items_per_s": rates[best],
            "batch1_latency_ms": percentiles(single_ms)}


def handle(handler: Handler, payloads: Sequence[Any]) -> list[Any]:
    """Everything kinference asks of the handler for one batch: ``validate`` each payload (which tokenises text),
    then ``preprocess``, ``inference`` and ``postprocess``."""
    items = [handler.validate(payload) for payload in payloads]
    return handler.postprocess(handler.inference(handler.preprocess(items)), items)


def measure_plain_model(model: torch.nn.Module, batches: Sequence[dict[str, torch.Tensor]], seconds: float
                        ) -> float:
    """Items per second of ``model`` (eager PyTorch, in inference mode) called on ``batches`` in turn for about
    ``seconds``: padded tensors already on the model's device, so nothing but the forward pass is timed. What
    no serving code around this model can pass on this device."""
    device = next(model.parameters()).device
    synchronize: Callable[[], None] = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    with torch.inference_mode():
        model(**batches[0])  # the first call of a shape
        synchronize()
        done, began = 0, time.monotonic()
        for index in itertools.count():
            batch = batches[index % len(batches)]
            model(**batch)
            done += len(batch["input_ids"])
            if time.monotonic() - began >= seconds:
                break
        synchronize()  # CUDA runs behind the launches: the clock stops when the last batch is done
    return round(done / (time.monotonic() - began), 1)
