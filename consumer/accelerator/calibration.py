"""Sizing at start: the device batch size and the number of workers, from a short measurement.

A device process calibrates once, after its warm-up and before it serves (a few seconds):

1. **The device's rate against batch size**, on the served length mix (the handler's ``calibration_payloads``: the
   text handlers draw them from a built-in corpus, option ``calibration_corpus``): each power-of-two batch size up
   to the largest allowed runs ``merge`` + ``inference`` until ``_ROUND_S`` has passed. The batch size is the
   smallest whose items/s is within ``_KNEE`` of the best: larger batches only add latency.
2. **One worker's host rate**: the handler's host work per item (``validate_many``, ``preprocess``,
   ``postprocess``, the reply's encoding), timed here on the same items, plus the service's own per-message work
   around it (``SERVICE_US_PER_MESSAGE``: Kafka, decoding, the commit ledger), which needs a broker to measure.
3. **Workers**: as many as it takes for the hosts to feed the device (its items/s x the host's µs per item), with
   ``_HEADROOM``; the supervisor then caps the sum over the devices by the cores (``worker_cap``).

The decision is logged in one line, written for the supervisor (``Calibration.write``) and exported as metrics.
Every choice can be overridden: ``--device-batch-size N`` and ``--workers N`` skip what they fix.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

from kinference.handlers.base import Handler
from kinference.protocol import encode_result

log = logging.getLogger(__name__)

SERVICE_US_PER_MESSAGE = 35.0
"""CPU µs per message of the service around the handler (librdkafka's consume, produce and delivery report,
decoding, the commit ledger): ``kinference drain``'s echo contender on this project's 2-core machine (34.8 µs,
docs/benchmarks.md). The worker count errs towards more workers where the host is slower."""
_ROUND_S = 0.25
"""How long each batch size runs: long enough to average a few batches, short enough for a start-up."""
_KNEE = 0.9
_HEADROOM = 1.25
"""Workers beyond the exact ratio: a worker is not busy all the time (polls, rebalances, GC)."""
_RESERVED_CORES = 1
"""Cores left to librdkafka's threads, the broker client and the system, beside the device processes."""


@dataclass(frozen=True)
class Calibration:
    batch_size: int
    """Rows per device batch."""
    device_items_s: float
    """The device's items/s at ``batch_size``."""
    host_us_per_item: float
    """One worker's CPU per item: the handler's host work plus ``SERVICE_US_PER_MESSAGE``."""
    workers: int
    """Workers this device can absorb."""
    curve: dict[int, float]
    """Items/s by batch size."""

    def slowest_batch_s(self) -> float:
        """The longest a measured batch took (its size over its items/s); 0 with nothing measured."""
        return max((size / rate for size, rate in self.curve.items() if rate > 0), default=0.0)

    def line(self) -> str:
        curve = ", ".join(f"{size}: {rate:,.0f}" for size, rate in self.curve.items())
        return (f"calibration: device batch size {self.batch_size} ({self.device_items_s:,.0f} items/s; items/s by "
                f"batch size {curve}); one worker's host work {self.host_us_per_item:.0f} µs per item; this device "
                f"can absorb {self.workers} workers")

    def write(self, path: Path) -> None:
        temporary = path.with_suffix(".tmp")
        temporary.write_bytes(orjson.dumps(asdict(self), option=orjson.OPT_NON_STR_KEYS))
        os.replace(temporary, path)

    @classmethod
    def read(cls, path: Path) -> Calibration | None:
        try:
            data = orjson.loads(path.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            return None
        data["curve"] = {int(size): rate for size, rate in data["curve"].items()}
        return cls(**data)


def calibrate(handler: Handler, max_rows: int, fixed_batch_size: int | None = None) -> Calibration | None:
    """Measure ``handler`` (set up with the ``device`` role, warmed up); None when it has no calibration payloads.
    ``fixed_batch_size``: the batch size is given (``--device-batch-size``); only its rate is measured."""
    payloads = handler.calibration_payloads(max_rows * 2)
    if not payloads:
        return None
    items = [item for item in handler.validate_many(payloads) if not isinstance(item, Exception)]
    if not items:
        return None
    sizes = [fixed_batch_size] if fixed_batch_size is not None else _powers_of_two(min(max_rows, len(items)))
    curve: dict[int, float] = {}
    for size in sizes:
        curve[size] = _device_rate(handler, items, size)
        if _past_the_knee(curve):
            break
    best = max(curve.values())
    batch_size = min(size for size, rate in curve.items() if rate >= _KNEE * best)
    host_us = _host_us_per_item(handler, payloads[:64]) + SERVICE_US_PER_MESSAGE
    device_rate = curve[batch_size]
    workers = max(1, math.ceil(device_rate * host_us / 1e6 * _HEADROOM))
    return Calibration(batch_size, device_rate, host_us, workers, curve)


def _past_the_knee(curve: dict[int, float]) -> bool:
    """Two doublings in a row gained less than ``1 - _KNEE``: larger batches would only take calibration time (on a
    CPU, seconds per batch)."""
    rates = list(curve.values())
    return len(rates) >= 3 and rates[-1] < rates[-3] / _KNEE and rates[-2] < rates[-3] / _KNEE


def worker_cap(devices: int, cores: int | None = None) -> int:
    """The most workers a host can run beside ``devices`` device processes: a core each for those, and
    ``_RESERVED_CORES``."""
    cores = cores if cores is not None else len(os.sched_getaffinity(0))
    return max(1, cores - devices - _RESERVED_CORES)


def _powers_of_two(limit: int) -> list[int]:
    sizes, size = [], 1
    while size < limit:
        sizes.append(size)
        size *= 2
    return [*sizes, limit]


def _device_rate(handler: Handler, items: list[Any], size: int) -> float:
    """Items/s of ``merge`` + ``inference`` on batches of ``size`` items drawn in turn from ``items``."""
    done, started, start = 0, time.perf_counter(), 0
    while True:
        batch = items[start : start + size]
        if len(batch) < size:
            start, batch = 0, items[:size]
        start += size
        handler.inference(handler.merge([handler.preprocess(batch)]))
        done += len(batch)
        elapsed = time.perf_counter() - started
        if elapsed >= _ROUND_S:
            return done / elapsed


def _host_us_per_item(handler: Handler, payloads: list[Any]) -> float:
    """CPU µs per item of what a worker does with the handler: validate, collate, postprocess, encode."""
    outputs = handler.inference(handler.merge([handler.preprocess(handler.validate_many(payloads))]))
    started = time.thread_time()
    items = handler.validate_many(payloads)
    handler.preprocess(items)
    for result in handler.postprocess(outputs, items):
        encode_result(result)
    return (time.thread_time() - started) * 1e6 / len(payloads)
