"""Which engine runs a text handler's model: torch (the default) or ONNX Runtime, on the CPU, optionally int8.

Options (``--handler-options key=value``):

- ``runtime`` (default ``torch``): ``onnxruntime`` exports the loaded model to ONNX at setup (about 2 s for
  MiniLM-L6) and serves it with an ONNX Runtime session on the CPU. Results match torch to float32 rounding.
  Needs ``pip install 'kinference[onnx]'``.
- ``quantize`` (default ``none``): ``int8`` quantises the exported model's weights to int8, per output channel,
  with ONNX Runtime's dynamic quantisation (activations are quantised per batch at run time). Faster, not
  exact: ``kinference cpu-paths`` measures speed and the cosine similarity to float32 on a corpus.

What was measured here (``kinference cpu-paths``: 2-core CPU, all-MiniLM-L6-v2, 1,024 mixed texts in
length-grouped batches of 32; docs/benchmarks.md "CPU paths") decided these options: ONNX Runtime in float32
runs at the speed of torch (0.99x) with the same results, and is offered because int8 needs it; int8 per
channel runs 1.47x torch (median of 3 rounds; 1.3-2.2x) at a cosine to float32 of 0.992 on average, 0.981 at
worst. torch's own dynamic int8 (``torch.ao.quantization.quantize_dynamic``, measured once by hand) was faster
(251 against 192 items/s in the same run) but far less exact (cosine mean/worst 0.934/0.838 per tensor,
0.973/0.935 per channel), too far for embeddings that are compared with each other, so it is not offered;
``compile`` (inductor, shape buckets)
ran at 0.79x torch on this CPU, the bucket padding costing more than the compiler saves.
"""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from kinference.errors import HandlerLoadError
from kinference.handlers.options import one_of

RUNTIMES = ("torch", "onnxruntime")
QUANTIZE = ("none", "int8")


class _Positional(torch.nn.Module):
    """The model called with positional tensors in a fixed order, returning its first output: what the ONNX
    exporter traces."""

    def __init__(self, model: torch.nn.Module, names: list[str]) -> None:
        super().__init__()
        self.model = model
        self.names = names

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        first: torch.Tensor = self.model(**dict(zip(self.names, tensors, strict=True)))[0]
        return first


class OnnxRuntimeForward:
    """A drop-in for ``model(**tensors)``: the same inputs, an output with the attribute the handler reads
    (``last_hidden_state``, ``logits``), computed by an ONNX Runtime session. Thread-safe: inference threads
    share one session (one copy of the weights), as they share one torch model."""

    def __init__(self, model: torch.nn.Module, example: dict[str, torch.Tensor], quantize: bool, threads: int,
                 workdir: Path) -> None:
        import onnxruntime

        self.quantized = quantize
        names = list(example)
        with torch.inference_mode():
            self.output_name = next(iter(model(**example).keys()))
        path = workdir / "model.onnx"
        rows_and_tokens = {0: "rows", 1: "tokens"}
        # The TorchScript exporter: it needs nothing beyond torch (the dynamo exporter needs onnxscript).
        # Tracing leaves the live module changed (measured: slower, different results), so a handler that
        # exports never runs the torch model again. Its warnings (deprecation, "might not generalize") are
        # silenced: tests/unit/handlers/test_runtime.py checks the exported model on padded batches of every length.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                _Positional(model, names), tuple(example[name] for name in names), str(path), input_names=names,
                output_names=[self.output_name], opset_version=17, dynamo=False,
                dynamic_axes={**{name: rows_and_tokens for name in names}, self.output_name: rows_and_tokens},
            )
        if quantize:
            from onnxruntime.quantization import QuantType, quantize_dynamic

            quantized = workdir / "model.int8.onnx"
            quantize_dynamic(str(path), str(quantized), weight_type=QuantType.QInt8, per_channel=True)
            path = quantized
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self.session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.inputs = [node.name for node in self.session.get_inputs()]

    def __call__(self, **tensors: torch.Tensor) -> SimpleNamespace:
        feed = {name: tensors[name].numpy() for name in self.inputs}
        (output,) = self.session.run([self.output_name], feed)
        return SimpleNamespace(**{self.output_name: torch.from_numpy(output)})


def forward_for(handler: str, options: dict[str, Any], model: torch.nn.Module,
                example: Callable[[], dict[str, torch.Tensor]], device: torch.device,
                dtype: torch.dtype) -> OnnxRuntimeForward | None:
    """The ONNX Runtime forward when ``options`` ask for it, else None (torch runs the model). ``example()``
    makes the batch the exporter traces. Every option that cannot go with ONNX Runtime fails setup, saying why."""
    runtime = one_of(handler, "runtime", options["runtime"], RUNTIMES)
    quantize = one_of(handler, "quantize", options["quantize"], QUANTIZE) == "int8"
    if runtime == "torch":
        if quantize:
            raise HandlerLoadError(f"{handler}: quantize=int8 needs runtime=onnxruntime")
        return None
    conflicts = [f"{key}={options[key]}" for key, default in (("compile", False), ("amp", "none"))
                 if options[key] != default]
    if dtype != torch.float32:
        conflicts.append(f"dtype={options['dtype']}")
    if device.type != "cpu":
        conflicts.append(f"device {device}")
    if conflicts:
        raise HandlerLoadError(f"{handler}: runtime=onnxruntime runs float32 models on the CPU; it cannot go "
                               f"with {', '.join(conflicts)}")
    try:
        import onnxruntime  # noqa: F401
    except ImportError as exc:
        raise HandlerLoadError(f"{handler}: runtime=onnxruntime needs pip install 'kinference[onnx]' ({exc})") from exc
    with tempfile.TemporaryDirectory(prefix="kinference-onnx-") as workdir:
        try:
            return OnnxRuntimeForward(model, example(), quantize, torch.get_num_threads(), Path(workdir))
        except Exception as exc:  # whatever fails in the export, the service cannot start
            raise HandlerLoadError(f"{handler}: cannot export the model to ONNX Runtime: {exc}") from exc
