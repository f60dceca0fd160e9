"""The ``runtime=onnxruntime`` and ``quantize=int8`` handler options (handlers/runtime.py)."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from kinference.errors import HandlerLoadError
from kinference.handlers import HandlerContext
from kinference.handlers.classification import TextClassificationHandler
from kinference.handlers.embedding import EmbeddingHandler
from kinference.handlers.text import TextHandler
from tests.models import build_tiny_classifier, reference_embeddings, varied_texts

pytestmark = pytest.mark.model


def set_up(handler: TextHandler, model: Path | None = None, **options: Any) -> Any:
    handler.setup(HandlerContext(device="cpu", model=model, options=options, max_batch_size=32))
    return handler


def run(handler: TextHandler, texts: list[str]) -> torch.Tensor:
    """The rows ``inference`` computes for ``texts`` as one batch (before postprocess)."""
    items = [handler.validate({"text": text}) for text in texts]
    return handler.inference(handler.preprocess(items))


@pytest.fixture(scope="module")
def onnx_embedding() -> EmbeddingHandler:
    return set_up(EmbeddingHandler(), runtime="onnxruntime")


def test_onnxruntime_embeddings_equal_torch_embeddings_computed_alone(onnx_embedding: EmbeddingHandler) -> None:
    texts = varied_texts(40)
    max_diff = (run(onnx_embedding, texts) - reference_embeddings(texts)).abs().max().item()
    assert max_diff <= 1e-4, f"max abs diff {max_diff:.2e}"
    assert onnx_embedding.describe()["runtime"] == "onnxruntime"


def test_int8_embeddings_stay_close_to_float32(onnx_embedding: EmbeddingHandler) -> None:
    texts = varied_texts(64)
    int8 = set_up(EmbeddingHandler(), runtime="onnxruntime", quantize="int8")
    cosines = torch.nn.functional.cosine_similarity(run(int8, texts), reference_embeddings(texts), dim=1)
    print(f"\nint8 cosine to float32: mean {cosines.mean():.4f}, min {cosines.min():.4f}")
    assert cosines.mean() >= 0.98 and cosines.min() >= 0.95
    assert not torch.allclose(run(int8, texts), run(onnx_embedding, texts), atol=1e-4)  # it is not float32
    assert int8.describe()["runtime"] == "onnxruntime-int8"


def test_inference_threads_share_one_session(onnx_embedding: EmbeddingHandler) -> None:
    batches = [varied_texts(8, seed=seed) for seed in range(6)]
    alone = [run(onnx_embedding, texts) for texts in batches]
    with ThreadPoolExecutor(3) as pool:
        together = list(pool.map(lambda texts: run(onnx_embedding, texts), batches))
    for one, other in zip(alone, together, strict=True):
        torch.testing.assert_close(one, other)


def test_onnxruntime_classifier_scores_equal_torch_scores(tmp_path: Path) -> None:
    """A model with token_type_ids and logits (not last_hidden_state) as its output."""
    model = build_tiny_classifier(tmp_path / "tiny")
    texts = ["I loved every minute of it", "no", "The delivery was late and the box was damaged."]
    torch_scores = run(set_up(TextClassificationHandler(), model), texts)
    onnx_scores = run(set_up(TextClassificationHandler(), model, runtime="onnxruntime"), texts)
    torch.testing.assert_close(onnx_scores, torch_scores, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("options", "message"), [
    ({"runtime": "tensorrt"}, "runtime must be one of torch, onnxruntime, not 'tensorrt'"),
    ({"quantize": "int8"}, "quantize=int8 needs runtime=onnxruntime"),
    ({"runtime": "onnxruntime", "quantize": "int4"}, "quantize must be one of none, int8, not 'int4'"),
    ({"runtime": "onnxruntime", "compile": True}, "cannot go with compile=True"),
    ({"runtime": "onnxruntime", "amp": "bfloat16", "dtype": "bfloat16"},
     "cannot go with amp=bfloat16, dtype=bfloat16"),
])
def test_options_that_cannot_work_fail_setup_saying_why(options: dict[str, Any], message: str) -> None:
    with pytest.raises(HandlerLoadError, match=message):
        set_up(EmbeddingHandler(), **options)


def test_without_onnxruntime_setup_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # makes the import fail
    with pytest.raises(HandlerLoadError, match=r"runtime=onnxruntime needs pip install 'kinference\[onnx\]'"):
        set_up(EmbeddingHandler(), runtime="onnxruntime")
