"""Shape buckets, options and device decisions of handlers/accelerate.py: pure logic, no model and no GPU."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest
import torch

from kinference.errors import HandlerLoadError
from kinference.handlers.accelerate import (
    Accelerator,
    CudaGraphs,
    ShapeBuckets,
    agreement,
    bucket_for,
    powers_of_two,
)
from kinference.handlers.text import TextHandler

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("low", "high", "expected"),
    [
        (1, 32, (1, 2, 4, 8, 16, 32)),
        (1, 24, (1, 2, 4, 8, 16, 24)),
        (1, 1, (1,)),
        (16, 256, (16, 32, 64, 128, 256)),
        (16, 100, (16, 32, 64, 100)),
        (16, 8, (8,)),
    ],
)
def test_powers_of_two_end_with_the_limit_itself(low: int, high: int, expected: tuple[int, ...]) -> None:
    assert powers_of_two(low, high) == expected


@pytest.mark.parametrize(("n", "expected"), [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, 12), (12, 12)])
def test_bucket_for_is_the_smallest_bucket_that_holds_n(n: int, expected: int) -> None:
    assert bucket_for(n, (1, 2, 4, 8, 12)) == expected


def test_bucket_for_more_than_the_largest_bucket_says_so() -> None:
    with pytest.raises(ValueError, match="13 is more than the largest bucket, 12"):
        bucket_for(13, (1, 2, 4, 8, 12))


def test_shape_buckets_pad_rows_and_tokens_separately() -> None:
    buckets = ShapeBuckets.up_to(max_batch_size=12, max_length=48)
    assert buckets == ShapeBuckets(rows=(1, 2, 4, 8, 12), lengths=(16, 32, 48))
    assert buckets.shape(3, 17) == (4, 32)
    assert buckets.shape(12, 48) == (12, 48)
    assert buckets.shape(1, 2) == (1, 16)
    assert len(buckets.all()) == 15
    assert set(buckets.all()) == {(rows, length) for rows in buckets.rows for length in buckets.lengths}


def accelerator(device: str = "cpu", **options: Any) -> Accelerator:
    """``from_options`` with the text handlers' defaults, as setup calls it."""
    given = {**TextHandler.defaults, **options}
    return Accelerator.from_options("text", given, torch.device(device), max_batch_size=8, max_length=64)


def test_by_default_nothing_is_accelerated() -> None:
    default = accelerator()
    assert (default.amp, default.compile_backend, default.buckets) == (None, None, None)
    assert default.describe() == {"amp": "none", "compile": "off", "cuda_graphs": "off", "shape_buckets": "off"}


def test_compiling_turns_shape_buckets_on_unless_told() -> None:
    compiled = accelerator(compile=True, compile_backend="eager")
    assert compiled.compile_backend == "eager"
    assert compiled.buckets == ShapeBuckets((1, 2, 4, 8), (16, 32, 64))
    assert accelerator(shape_buckets=True).buckets == compiled.buckets
    assert accelerator(amp="bfloat16", compile=True).describe() == {
        "amp": "bfloat16",
        "compile": "inductor",
        "cuda_graphs": "off",
        "shape_buckets": "on",
    }


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"amp": "fp16"}, "text: handler option amp must be one of none, float16, bfloat16, not 'fp16'"),
        ({"amp": ["bfloat16"]}, "amp must be one of none, float16, bfloat16, not ['bfloat16']"),
        ({"amp": "float16"}, "amp=float16 needs a GPU; on the CPU use amp=bfloat16"),
        ({"compile": "yes"}, "handler option compile must be true or false, not 'yes'"),
        ({"shape_buckets": 1}, "handler option shape_buckets must be true or false, not 1"),
        ({"compile": True, "shape_buckets": False}, "compile=true needs shape_buckets=true"),
        ({"compile": True, "compile_backend": "inductr"}, "compile_backend must be a torch.compile backend such as"),
        ({"cuda_graphs": True}, "cuda_graphs=true needs a CUDA device, not cpu"),
        ({"cuda_graphs": "maybe"}, "handler option cuda_graphs must be true or false, not 'maybe'"),
    ],
)
def test_bad_options_fail_with_the_fix(options: dict[str, Any], expected: str) -> None:
    with pytest.raises(HandlerLoadError) as raised:
        accelerator(**options)
    assert expected in str(raised.value)


def test_a_gpu_may_run_float16() -> None:
    assert accelerator("cuda", amp="float16").amp is torch.float16


def test_a_compiled_model_without_buckets_cannot_be_built() -> None:
    with pytest.raises(ValueError, match="a compiled or graphed model needs shape buckets"):
        Accelerator(CPU, compile_backend="eager")


def test_off_cuda_batches_stay_in_plain_memory_on_the_default_stream() -> None:
    cpu = accelerator()
    assert not cpu.cuda
    tensor = torch.zeros(2, 3)
    assert cpu.host(tensor) is tensor
    assert cpu.to_device({"t": tensor})["t"] is tensor
    assert isinstance(cpu.stream(), nullcontext)
    assert isinstance(cpu.autocast(), nullcontext)


@pytest.mark.parametrize(("device", "cuda"), [("cuda", True), ("cuda:1", True), ("cpu", False), ("mps", False)])
def test_only_cuda_devices_use_pinned_memory_and_streams(device: str, cuda: bool) -> None:
    # Deciding needs no GPU: only torch.device, which parses any device string.
    assert Accelerator(torch.device(device)).cuda is cuda


def test_bfloat16_amp_autocasts_on_the_cpu() -> None:
    with accelerator(amp="bfloat16").autocast():
        assert torch.is_autocast_enabled("cpu")
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


def test_compile_leaves_an_uncompiled_model_as_it_is_and_wraps_a_compiled_one() -> None:
    model = torch.nn.Linear(2, 2)
    assert accelerator().compile(model) is model
    compiled = accelerator(compile=True, compile_backend="eager").compile(model)
    assert compiled is not model
    torch.testing.assert_close(compiled(torch.ones(1, 2)), model(torch.ones(1, 2)))


def test_cuda_graphs_are_on_by_default_with_cuda_and_bring_shape_buckets() -> None:
    # Deciding needs no GPU; capturing does (below: what happens where a capture fails).
    gpu = accelerator("cuda")
    assert gpu.graphs and gpu.buckets == ShapeBuckets((1, 2, 4, 8), (16, 32, 64))
    assert isinstance(gpu.compile(torch.nn.Linear(2, 2)), CudaGraphs)
    assert not accelerator("cuda", cuda_graphs=False).graphs
    assert not accelerator("cuda", compile=True).graphs  # compile on CUDA graphs the compiled model itself
    with pytest.raises(HandlerLoadError, match="cuda_graphs needs shape_buckets=true"):
        accelerator("cuda", shape_buckets=False)


class _Encoder(torch.nn.Module):
    """A model called as the text handlers call theirs: keyword tensors in, a mapping of tensors out."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(100, 4)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"last_hidden_state": self.embed(input_ids) * attention_mask.unsqueeze(-1)}


def test_a_shape_whose_graph_cannot_be_captured_runs_eagerly_with_the_same_results(caplog) -> None:
    # On this machine (no GPU) every capture fails, as an op that cannot be captured fails on a GPU: the shape is
    # remembered as eager, and runs so from then on, without trying again.
    model = _Encoder()
    graphed = CudaGraphs(model, CPU)
    inputs = {"input_ids": torch.tensor([[1, 2, 0]]), "attention_mask": torch.tensor([[1, 1, 0]])}
    with caplog.at_level("WARNING"):
        first = graphed(**inputs)
    assert "CUDA graph capture failed" in caplog.text
    torch.testing.assert_close(first["last_hidden_state"], model(**inputs)["last_hidden_state"])
    caplog.clear()
    graphed(**inputs)
    assert "capture failed" not in caplog.text  # once per shape
    graphed.capturing = False
    other = {"input_ids": torch.tensor([[3, 4]]), "attention_mask": torch.tensor([[1, 1]])}
    torch.testing.assert_close(graphed(**other)["last_hidden_state"], model(**other)["last_hidden_state"])
    assert "capture failed" not in caplog.text  # after the warm-up, a new shape is not captured


def test_agreement_is_the_worst_row_cosine() -> None:
    reference = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    assert agreement(reference, reference) == pytest.approx(1.0)
    assert agreement(reference, torch.tensor([[1.0, 0.0], [1.0, 1.0]])) == pytest.approx(2**-0.5)
