"""How a text handler runs its batches on the device: shape buckets, AMP, ``torch.compile``, CUDA copies and streams.

Options (``--handler-options key=value``), read once by ``Accelerator.from_options``:

- ``amp`` (default ``none``): ``float16`` or ``bfloat16`` runs the forward pass under ``torch.autocast``.
  The CPU gets ``bfloat16`` only.
- ``compile`` (default false): run ``torch.compile(model, dynamic=False)`` with ``compile_backend`` (default
  ``inductor``; ``eager`` and ``aot_eager`` help to debug). It needs shape buckets, and ``warm_up`` compiles
  every bucket shape before serving (seconds each), so nothing compiles while serving.
- ``cuda_graphs`` (default ``auto``: on with CUDA, off elsewhere): capture the model's forward once per shape
  bucket into a CUDA graph at warm-up (``CudaGraphs``) and replay it: one launch per batch instead of one per kernel,
  which is what bounds an eager encoder of MiniLM's or BERT-base's size on a fast GPU. It needs shape buckets; a
  shape that was not captured (or whose capture failed) runs eagerly. ``compile=true`` uses
  ``torch.compile(mode="reduce-overhead")`` on CUDA instead, which captures graphs of the compiled model.
- ``shape_buckets`` (default: on when compiling or capturing CUDA graphs): pad each batch up to a bucket of rows
  (powers of two up to the micro-batch size) and of tokens (powers of two from 16 up to ``max_length``), so shapes
  repeat.

The text handlers' ``dtype=auto`` (the default) is the other half of the GPU defaults: float16 weights on CUDA
where the warm-up batch agrees with float32 (``agreement``), else bfloat16, else float32; float32 elsewhere.

On CUDA a batch is collated into pinned host memory, copied with ``non_blocking=True`` and run on a CUDA stream
of its inference thread's own, so one thread's copies overlap another's compute. Elsewhere none of that happens.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from kinference.errors import HandlerLoadError
from kinference.handlers.options import boolean, one_of

log = logging.getLogger(__name__)

AMP_DTYPES = {"none": None, "float16": torch.float16, "bfloat16": torch.bfloat16}

SHORTEST_LENGTH_BUCKET = 16
"""Shorter buckets would add shapes to compile for almost no saved work."""


def powers_of_two(low: int, high: int) -> tuple[int, ...]:
    """``low``, ``2 * low``, ``4 * low``... while below ``high``, then ``high`` itself: buckets up to a limit."""
    sizes = []
    size = low
    while size < high:
        sizes.append(size)
        size *= 2
    return (*sizes, high)


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """The smallest of the sorted ``buckets`` that holds ``n``."""
    index = bisect.bisect_left(buckets, n)
    if index == len(buckets):
        raise ValueError(f"{n} is more than the largest bucket, {buckets[-1]}")
    return buckets[index]


@dataclass(frozen=True)
class ShapeBuckets:
    """The shapes a bucketed batch is padded to: a bucket of rows by a bucket of tokens."""

    rows: tuple[int, ...]
    lengths: tuple[int, ...]

    @classmethod
    def up_to(cls, max_batch_size: int, max_length: int) -> ShapeBuckets:
        return cls(powers_of_two(1, max_batch_size), powers_of_two(SHORTEST_LENGTH_BUCKET, max_length))

    def shape(self, items: int, longest: int) -> tuple[int, int]:
        """(rows, tokens) of a batch of ``items`` whose longest holds ``longest`` tokens."""
        return bucket_for(items, self.rows), bucket_for(longest, self.lengths)

    def all(self) -> list[tuple[int, int]]:
        return list(itertools.product(self.rows, self.lengths))


@dataclass(frozen=True)
class Accelerator:
    """The device and the options above, checked at setup; shared by the handler's threads."""

    device: torch.device
    amp: torch.dtype | None = None
    compile_backend: str | None = None
    """``None``: the model runs eagerly."""
    graphs: bool = False
    """Capture a CUDA graph per bucket shape (``CudaGraphs``)."""
    buckets: ShapeBuckets | None = None
    """``None``: a batch is as long as its longest item and has one row per item."""
    _streams: threading.local = field(default_factory=threading.local, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if (self.compile_backend is not None or self.graphs) and self.buckets is None:
            raise ValueError("a compiled or graphed model needs shape buckets, or each new batch shape compiles again")

    @classmethod
    def from_options(
        cls, handler: str, options: dict[str, Any], device: torch.device, max_batch_size: int, max_length: int
    ) -> Accelerator:
        amp = AMP_DTYPES[one_of(handler, "amp", options["amp"], AMP_DTYPES)]
        if amp is torch.float16 and device.type == "cpu":
            raise HandlerLoadError(f"{handler}: amp=float16 needs a GPU; on the CPU use amp=bfloat16")
        compiled = boolean(handler, "compile", options["compile"])
        graphs = _cuda_graphs(handler, options["cuda_graphs"], device) and not compiled
        given = options["shape_buckets"]
        bucketed = (compiled or graphs) if given is None else boolean(handler, "shape_buckets", given)
        if (compiled or graphs) and not bucketed:
            what = "compile=true" if compiled else "cuda_graphs"
            raise HandlerLoadError(
                f"{handler}: {what} needs shape_buckets=true (or leave shape_buckets out): "
                "without buckets every new batch shape would compile again while serving"
            )
        backend = _compile_backend(handler, options["compile_backend"]) if compiled else None
        return cls(device, amp, backend, graphs, ShapeBuckets.up_to(max_batch_size, max_length) if bucketed else None)

    @property
    def cuda(self) -> bool:
        """Whether batches go through pinned memory and per-thread streams: only CUDA has both."""
        return self.device.type == "cuda"

    def host(self, tensor: torch.Tensor) -> torch.Tensor:
        """Where collation leaves a tensor: pinned on CUDA, so that the copy to the GPU can be asynchronous."""
        return tensor.pin_memory() if self.cuda else tensor

    def to_device(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: tensor.to(self.device, non_blocking=self.cuda) for name, tensor in tensors.items()}

    def stream(self) -> AbstractContextManager[Any]:
        """Make the calling thread's own CUDA stream current (nothing off CUDA)."""
        if not self.cuda:
            return nullcontext()
        stream = getattr(self._streams, "stream", None)
        if stream is None:
            stream = self._streams.stream = torch.cuda.Stream(self.device)
            # The weights were copied on the default stream: this stream must not read them before they land.
            stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(stream)

    def autocast(self) -> AbstractContextManager[Any]:
        return nullcontext() if self.amp is None else torch.autocast(self.device.type, dtype=self.amp)

    def compile(self, model: torch.nn.Module) -> Callable[..., Any]:
        """The model as ``inference`` calls it: compiled when ``compile`` is on, graphed with ``cuda_graphs``."""
        if self.graphs:
            return CudaGraphs(model, self.device)
        if self.compile_backend is None:
            return model
        # dynamic=False makes one graph per shape, but dynamo keeps 8 per function by default and runs any
        # further shape eagerly. The limit is process-wide; raising it does not hurt other compiled code.
        assert self.buckets is not None, "from_options refuses compile_backend without shape buckets"
        shapes = len(self.buckets.all())
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, shapes)
        if self.cuda and self.compile_backend == "inductor":  # CUDA graphs of the compiled model, per shape
            return torch.compile(model, dynamic=False, mode="reduce-overhead")
        return torch.compile(model, dynamic=False, backend=self.compile_backend)

    def describe(self) -> dict[str, str]:
        return {
            "amp": "none" if self.amp is None else str(self.amp).removeprefix("torch."),
            "compile": self.compile_backend or "off",
            "cuda_graphs": "on" if self.graphs else "off",
            "shape_buckets": "off" if self.buckets is None else "on",
        }


def _cuda_graphs(handler: str, value: Any, device: torch.device) -> bool:
    """``auto``: on with CUDA; ``true`` off CUDA is an error (there are no CUDA graphs to capture)."""
    if value == "auto":
        return device.type == "cuda"
    on = boolean(handler, "cuda_graphs", value)
    if on and device.type != "cuda":
        raise HandlerLoadError(f"{handler}: cuda_graphs=true needs a CUDA device, not {device}")
    return on


class CudaGraphs:
    """The model's forward, replayed from a CUDA graph per input shape (torch's "capture by hand" recipe).

    A shape is captured the first time it runs while ``capturing`` (the warm-up runs every bucket shape); after
    that, a shape not captured, or whose capture failed, runs eagerly. The graphs share one memory pool, so one
    replays at a time: the lock covers copying the inputs into the graph's static tensors, the replay and cloning
    the outputs out, all on the calling thread's stream; a replay waits (on the GPU, not the CPU) for the previous
    one's stream to be done with the static tensors. Only CUDA has graphs: on any other device this is never made.
    """

    def __init__(self, model: Callable[..., Any], device: torch.device) -> None:
        self._model = model
        self._device = device
        self._graphs: dict[tuple[tuple[str, tuple[int, ...]], ...], _Graph | None] = {}
        self._lock = threading.Lock()
        self._pool: Any = None
        self._done: Any = None
        """The CUDA event after the last replay's outputs were cloned: the next replay's stream waits for it."""
        self.capturing = True

    def __call__(self, **inputs: torch.Tensor) -> Any:
        key = tuple((name, tuple(tensor.shape)) for name, tensor in inputs.items())
        graph = self._graphs.get(key)
        if graph is None and self.capturing and key not in self._graphs:
            graph = self._graphs[key] = self._capture(inputs)
        if graph is None:
            return self._model(**inputs)
        stream = torch.cuda.current_stream(self._device)
        with self._lock:
            if self._done is not None:
                stream.wait_event(self._done)
            for name, tensor in inputs.items():
                graph.inputs[name].copy_(tensor, non_blocking=True)
            graph.graph.replay()
            outputs = {name: value.clone() for name, value in graph.outputs.items()}
            self._done = torch.cuda.Event()
            self._done.record(stream)
        return SimpleNamespace(**outputs)

    def _capture(self, inputs: dict[str, torch.Tensor]) -> _Graph | None:
        try:
            static = {name: tensor.clone() for name, tensor in inputs.items()}
            side = torch.cuda.Stream(self._device)
            side.wait_stream(torch.cuda.current_stream(self._device))
            with torch.cuda.stream(side):  # warm up on a side stream, as torch's recipe asks, then capture
                for _ in range(2):
                    self._model(**static)
            torch.cuda.current_stream(self._device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self._pool):
                output = self._model(**static)
            tensors = {name: value for name, value in output.items() if isinstance(value, torch.Tensor)}
            return _Graph(graph, static, tensors)
        except Exception as exc:  # e.g. an op that cannot be captured: this shape runs eagerly
            log.warning("CUDA graph capture failed for shapes %s; they run eagerly: %r",
                        {name: tuple(tensor.shape) for name, tensor in inputs.items()}, exc)
            return None


@dataclass(frozen=True)
class _Graph:
    graph: Any
    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]


def agreement(reference: torch.Tensor, candidate: torch.Tensor) -> float:
    """The lowest cosine similarity between rows of ``reference`` and ``candidate`` (the same rows computed in
    another precision): how far a reduced precision moves the worst result."""
    rows = reference.float().reshape(len(reference), -1)
    return float(torch.nn.functional.cosine_similarity(rows, candidate.float().reshape(len(candidate), -1)).min())


def _compile_backend(handler: str, backend: Any) -> str:
    # Debug backends such as eager are accepted, but the message lists only the ones meant for serving.
    if not isinstance(backend, str) or backend not in torch.compiler.list_backends(exclude_tags=()):
        raise HandlerLoadError(
            f"{handler}: handler option compile_backend must be a torch.compile backend such as "
            f"{', '.join(torch.compiler.list_backends())}, not {backend!r}"
        )
    return backend
