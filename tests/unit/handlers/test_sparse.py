"""The sparse handler against sentence-transformers' own ``SparseEncoder.encode``, on tiny random SPLADE models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kinference.errors import HandlerLoadError, InvalidInput
from kinference.handlers import HandlerContext
from kinference.handlers.sparse import SparseHandler
from tests.models import build_tiny_sparse_encoder, varied_texts

# The reference: the `reference` extra, 6.2 (the lowest-versions run has 5.7, which the bundled MiniLM brings, on an
# older transformers: a tiny model initialises otherwise there, and these tests are for the reference they name).
pytest.importorskip("sentence_transformers", minversion="6.2",
                    reason="sentence-transformers 6.2 (pip install 'kinference[reference]') is the reference these "
                    "tests compare with")

pytestmark = pytest.mark.model

# From one word to past the model's 128 positions, in one batch: padding must not leak into any vector.
TEXTS = ["kafka", *varied_texts(5, seed=11, max_words=60), " ".join(["the broker sat on the mat"] * 40)]


@pytest.fixture(scope="module")
def sparse_encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_sparse_encoder(tmp_path_factory.mktemp("sparse-encoder"))


def set_up(model: Path, max_batch_size: int = 32, **options: Any) -> SparseHandler:
    handler = SparseHandler()
    handler.setup(HandlerContext(device="cpu", model=model, options=options, max_batch_size=max_batch_size))
    return handler


def serve(handler: SparseHandler, payloads: list[Any]) -> list[Any]:
    items = handler.validate_many(payloads)
    return handler.postprocess(handler.inference(handler.preprocess(items)), items)


def reference(model: Path, texts: list[str]) -> torch.Tensor:
    """``SparseEncoder.encode``'s sparse tensor, as a dense one."""
    from sentence_transformers import SparseEncoder

    encoded = SparseEncoder(str(model), device="cpu", local_files_only=True).encode(texts)
    assert encoded.is_sparse
    return encoded.to_dense()


def assert_equal_to(vector: dict[str, Any], expected: torch.Tensor) -> None:
    """The reply's nonzero weights, indices ascending, are the reference's vector within 1e-4 (compared whole: an
    index whose weight is a rounding error above 0 in one and 0 in the other still agrees)."""
    indices, values = np.asarray(vector["indices"]), np.asarray(vector["values"])
    assert list(indices) == sorted(set(indices)) and (values > 0).all()
    assert 10 <= len(indices) < len(expected) / 10  # sparse, and not empty: the comparison means something
    dense = np.zeros(len(expected), dtype=np.float32)
    dense[indices] = values
    np.testing.assert_allclose(dense, expected.numpy(), atol=1e-4, rtol=0)


@pytest.mark.parametrize(("max_batch_size", "options"), [
    (32, {}),
    (2, {"shape_buckets": True}),  # the rows run in parts of 2, each padded to a bucket shape
    (32, {"runtime": "onnxruntime"}),
], ids=["eager", "parts-of-2-bucketed", "onnxruntime"])
def test_vectors_equal_sparse_encoder_encode_with_texts_of_very_different_lengths(
    sparse_encoder: Path, max_batch_size: int, options: dict[str, Any]
) -> None:
    handler = set_up(sparse_encoder, max_batch_size, **options)
    assert handler.max_length == 128
    replies = serve(handler, [{"text": text} for text in TEXTS])
    expected = reference(sparse_encoder, TEXTS)
    for reply, row in zip(replies, expected, strict=True):
        assert set(reply) == {"indices", "values"}
        assert_equal_to(reply, row)


def test_an_input_list_shares_the_batch_with_single_texts_and_is_answered_as_a_list(sparse_encoder: Path) -> None:
    handler = set_up(sparse_encoder)
    single, listed = serve(handler, [{"text": TEXTS[0]}, {"input": TEXTS[1:]}])
    expected = reference(sparse_encoder, TEXTS)
    assert_equal_to(single, expected[0])
    assert listed["object"] == "list" and [entry["index"] for entry in listed["data"]] == list(range(len(TEXTS) - 1))
    for entry, row in zip(listed["data"], expected[1:], strict=True):
        assert entry["object"] == "sparse_embedding"
        assert_equal_to(entry, row)
    assert listed["usage"]["total_tokens"] == handler.cost(handler.validate({"input": TEXTS[1:]}))


def test_sum_pooling_and_a_saved_max_active_dims_are_read_from_the_model(tmp_path: Path) -> None:
    model = build_tiny_sparse_encoder(tmp_path, pooling="sum", seed=2)
    settings = model / "config_sentence_transformers.json"
    settings.write_text(json.dumps({**json.loads(settings.read_text()), "max_active_dims": 12}))
    replies = serve(set_up(model), [{"text": text} for text in TEXTS[:4]])
    expected = reference(model, TEXTS[:4])
    for reply, row in zip(replies, expected, strict=True):
        assert len(reply["indices"]) == 12 and (row > 0).sum() == 12
        assert_equal_to(reply, row)


def test_the_device_process_path_answers_one_entry_per_request(sparse_encoder: Path) -> None:
    host = SparseHandler()
    host.setup(HandlerContext(device="cpu", model=sparse_encoder, role="host"))
    device = set_up(sparse_encoder, max_batch_size=2, shape_buckets=True)
    first = host.validate_many([{"input": TEXTS[:5]}])
    second = host.validate_many([{"text": TEXTS[5]}, {"text": TEXTS[6]}])
    outputs = device.inference(device.merge([host.preprocess(first), host.preprocess(second)]))
    assert len(outputs) == 3
    replies = host.postprocess(outputs[:1], first) + host.postprocess(outputs[1:], second)
    expected = reference(sparse_encoder, TEXTS)
    for entry, row in zip(replies[0]["data"], expected[:5], strict=True):
        assert_equal_to(entry, row)
    assert_equal_to(replies[1], expected[5])
    assert_equal_to(replies[2], expected[6])


@pytest.mark.parametrize(("payload", "expected"), [
    ({"txt": "a"}, 'missing "text"'),
    ({"text": " "}, '"text" is empty'),
    ({"input": []}, '"input" must be a string or a non-empty array of strings'),
    ({"input": ["a", 3]}, '"input" must be a string or a non-empty array of strings'),
    ({"input": ["a", ""]}, '"text" is empty'),
])
def test_bad_requests_are_refused_with_what_is_wrong(sparse_encoder: Path, payload: Any, expected: str) -> None:
    handler = set_up(sparse_encoder)
    with pytest.raises(InvalidInput, match=expected):
        handler.validate(payload)


def test_a_model_with_modules_the_handler_does_not_compute_is_refused(tmp_path: Path) -> None:
    model = build_tiny_sparse_encoder(tmp_path)
    modules = json.loads((model / "modules.json").read_text())
    modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.base.modules.Dense"})
    (model / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(HandlerLoadError, match="masked-LM Transformer followed by SpladePooling only"):
        set_up(model)


def test_a_prompt_goes_before_every_text_as_sparse_encoder_puts_it(sparse_encoder: Path) -> None:
    handler = set_up(sparse_encoder)
    plain, prompted = serve(handler, [{"input": TEXTS[:3]}, {"input": TEXTS[:3], "prompt": "query: "}])
    from sentence_transformers import SparseEncoder

    expected = SparseEncoder(str(sparse_encoder), device="cpu").encode(TEXTS[:3], prompt="query: ").to_dense()
    for entry, row in zip(prompted["data"], expected, strict=True):
        assert_equal_to(entry, row)
    assert plain["data"][0]["indices"].tolist() != prompted["data"][0]["indices"].tolist()


def test_dtype_auto_compares_precisions_on_sparse_rows(sparse_encoder: Path) -> None:
    handler = set_up(sparse_encoder)
    _, dtype = handler._reduced_precision(handler.model)
    assert dtype in (torch.float16, torch.bfloat16, torch.float32)
