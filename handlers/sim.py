"""``sim``: a simulated accelerator, for benchmarks of the host path around a fast GPU.

Requests are validated and tokenised exactly as the ``embedding`` handler does (the same tokenizer, the same
token costs, the same collation), so everything around the model does its real work. Only the model is
simulated: ``inference`` queues ``fixed_ms + per_token_us x padded tokens`` of work on one simulated device and
waits for it with the GIL released, as a CUDA stream synchronise does, then returns zero embeddings of the
model's width. The device runs one batch at a time, in the order they were queued: with several inference
threads (CUDA streams) a batch queued while another runs starts as soon as that one ends, so the device does
not idle while a thread waits for the GIL between batches.

The defaults model MiniLM-L6 (all-MiniLM-L6-v2) on a current data-centre GPU in half precision. The published
figure is sentence-transformers' 14,200 sentences/s for this model on a V100 (sbert.net, "Pretrained Models");
at about 30 padded tokens per short sentence that is ~2.3 us per token, and an H100 in fp16 is about four times
a V100 on BERT-sized encoders, hence ``per_token_us=0.5``. ``fixed_ms=1.0`` is the launch cost of an eager
6-layer encoder (~60 kernels of ~15 us each). Options ``fixed_ms`` and ``per_token_us`` set other devices.

One device per host: with ``serve --workers N`` (``HandlerContext.host_dir`` given) every worker queues on the
same simulated device, kept in a small file of that directory under an exclusive ``fcntl.flock`` (``SharedDevice``),
as N processes' CUDA contexts share one GPU; in a single process the device is the process's (``Device``).

``stats()`` reports the time the simulated device was busy, so a benchmark can give its busy fraction; with a
shared device, the whole host's.
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from kinference.errors import HandlerLoadError
from kinference.handlers.base import HandlerContext
from kinference.handlers.embedding import EmbeddingHandler
from kinference.handlers.text import TextBatch


class SimulatedAccelerator(EmbeddingHandler):
    name = "sim"
    # truncate: the benchmarks' corpora hold a few texts past 256 tokens, which the simulated device computes cut, as
    # it always did, rather than answer with input_too_long (a cheaper, different workload).
    defaults = {**EmbeddingHandler.defaults, "fixed_ms": 1.0, "per_token_us": 0.5, "truncate": True}

    def _load_model(self, model_dir: Path, dtype: torch.dtype) -> Any:
        """No weights to run: the configuration (``self.config``) is all there is."""
        return SimpleNamespace(config=self.config)

    def setup(self, context: HandlerContext) -> None:
        super().setup(context)
        # A worker beside a device process queues nothing: the device process has the simulated device.
        self._device: Device | SharedDevice | None = None
        if context.role != "host":
            self._device = Device() if context.host_dir is None else SharedDevice(Path(context.host_dir) / DEVICE_FILE)

    def configure(self, options: dict[str, Any]) -> None:
        super().configure(options)
        self.fixed_s = _non_negative(options, "fixed_ms") / 1000
        self.per_token_s = _non_negative(options, "per_token_us") / 1_000_000
        self._width = int(self.config.hidden_size)

    def forward_rows(self, inputs: TextBatch) -> torch.Tensor:
        assert self._device is not None, "inference runs in the device process"
        done_at = self._device.queue(self.fixed_s + self.per_token_s * inputs.tensors["input_ids"].numel())
        time.sleep(max(0.0, done_at - time.monotonic()))  # releases the GIL, as waiting for a GPU does
        return torch.zeros(inputs.real_rows, self._width)

    def stats(self) -> dict[str, float]:
        """Seconds the simulated device has been busy, and the calls it ran (with a shared device: every worker's)."""
        return self._device.stats() if self._device is not None else {"busy_s": 0.0, "calls": 0}

    def close(self) -> None:
        if self._device is not None:
            self._device.close()
        super().close()

    def describe(self) -> dict[str, str]:
        return {**super().describe(), "simulated": f"{self.fixed_s * 1000:g} ms + {self.per_token_s * 1e6:g} us/token"}


DEVICE_FILE = "sim-device"


class Device:
    """One simulated device in this process: batches run one at a time, in the order they were queued."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free_at = 0.0
        """``time.monotonic()`` when the device has finished all the work queued on it."""
        self._busy_s = 0.0
        self._calls = 0

    def queue(self, seconds: float) -> float:
        """Queue ``seconds`` of work; the ``time.monotonic()`` at which it is done."""
        with self._lock:
            done_at = self._free_at = max(time.monotonic(), self._free_at) + seconds
            self._busy_s += seconds
            self._calls += 1
        return done_at

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {"busy_s": self._busy_s, "calls": self._calls}

    def close(self) -> None:
        """Nothing to release."""


class SharedDevice:
    """One simulated device for every process that opens the same file: its queue's end, busy time and call count
    live in the file (three doubles), read and written under an exclusive ``flock``. ``time.monotonic()`` is the
    host's CLOCK_MONOTONIC, the same in every process."""

    _LAYOUT = struct.Struct("=3d")

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self._lock = threading.Lock()  # flock is per open file: the threads of one process take turns here first

    def queue(self, seconds: float) -> float:
        # Locked in line, not through ``_locked``: once per device batch, where a generator's frames cost as much as
        # the lock.
        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                free_at, busy_s, calls = self._read()
                done_at = max(time.monotonic(), free_at) + seconds
                os.pwrite(self._fd, self._LAYOUT.pack(done_at, busy_s + seconds, calls + 1), 0)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        return done_at

    def stats(self) -> dict[str, float]:
        with self._locked():
            _, busy_s, calls = self._read()
        return {"busy_s": busy_s, "calls": int(calls)}

    def close(self) -> None:
        os.close(self._fd)

    def _read(self) -> tuple[float, float, float]:
        raw = os.pread(self._fd, self._LAYOUT.size, 0)
        return self._LAYOUT.unpack(raw) if len(raw) == self._LAYOUT.size else (0.0, 0.0, 0.0)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)


def _non_negative(options: dict[str, Any], key: str) -> float:
    value = options[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise HandlerLoadError(f"sim: handler option {key} must be a number >= 0, not {value!r}")
    return float(value)
