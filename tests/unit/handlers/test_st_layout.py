"""The embedding handler against sentence-transformers itself, on tiny random models of every layout it reads.

Each model is saved by sentence-transformers (tests/models.py ``build_st_model``); ``SentenceTransformer(dir).encode``
on the same texts is the reference. Texts of very different lengths share each batch (padding must not leak into a
vector), with and without prompts mixed in it."""

from __future__ import annotations

import json
import logging
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

# The reference: the `reference` extra, 6.2 (the lowest-versions run has 5.7, which the bundled MiniLM brings, on an
# older transformers: a tiny model initialises otherwise there, and these tests are for the reference they name).
pytest.importorskip("sentence_transformers", minversion="6.2",
                    reason="sentence-transformers 6.2 (pip install 'kinference[reference]') is the reference these "
                    "tests compare with")
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer import modules

from kinference.errors import HandlerLoadError, InputTooLong, InvalidInput
from kinference.handlers import HandlerContext
from kinference.handlers.embedding import EmbeddingHandler
from kinference.protocol import ErrorCode, decode_embedding
from tests.models import ST_LAYOUTS, build_tiny_classifier, varied_texts

pytestmark = pytest.mark.model

AGREE = 0.9999
"""The lowest cosine between the handler's vector and sentence-transformers' that counts as the same."""


def set_up(model: Path, max_batch_size: int = 16, **options: Any) -> EmbeddingHandler:
    handler = EmbeddingHandler()
    handler.setup(HandlerContext(device="cpu", model=model, options=options, max_batch_size=max_batch_size))
    return handler


def answers(handler: EmbeddingHandler, payloads: list[Any]) -> list[Any]:
    """Each payload's result, or the exception that refused it, computed as one batch."""
    items = handler.validate_many(payloads)
    valid = [item for item in items if not isinstance(item, Exception)]
    results = iter(handler.postprocess(handler.inference(handler.preprocess(valid)), valid) if valid else [])
    return [item if isinstance(item, Exception) else next(results) for item in items]


def vectors(handler: EmbeddingHandler, payloads: list[Any]) -> np.ndarray:
    return np.array([vector(result["embedding"]) for result in answers(handler, payloads)])


def vector(embedding: Any) -> np.ndarray:
    """An embedding of a result: a float32 array, or its base64 (``encoding_format=base64``)."""
    return np.asarray(decode_embedding(embedding) if isinstance(embedding, str) else embedding)


@cache
def reference(model: Path) -> SentenceTransformer:
    return SentenceTransformer(str(model), device="cpu")


def assert_agree(ours: np.ndarray, theirs: np.ndarray) -> None:
    assert ours.shape == theirs.shape
    cosines = (ours * theirs).sum(axis=1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(theirs, axis=1))
    assert cosines.min() >= AGREE, f"cosines to sentence-transformers: {np.round(cosines, 6).tolist()}"
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), np.linalg.norm(theirs, axis=1), rtol=1e-3)


TEXTS = [*varied_texts(6, seed=35, max_words=90), "a", "Kafka!"]
"""From one word to about 100 tokens, in one batch."""


@pytest.mark.parametrize("layout", ST_LAYOUTS)
@pytest.mark.parametrize("shape_buckets", [False, True])
def test_every_layout_equals_sentence_transformers_with_prompts_mixed_in_one_batch(
        st_model: Any, layout: str, shape_buckets: bool) -> None:
    model = st_model(layout)
    handler = set_up(model, shape_buckets=shape_buckets)
    st = reference(model)
    names = [name for name, text in st.prompts.items() if text]
    asks: list[dict[str, str]] = [{}, {"prompt": "custom: "}, *({"prompt_name": name} for name in names)]
    payloads = [{"text": text, **asks[index % len(asks)]} for index, text in enumerate(TEXTS)]
    ours = vectors(handler, payloads)
    for ask in asks:
        rows = [index for index, payload in enumerate(payloads) if payload.keys() - {"text"} == ask.keys()
                and all(payload[key] == value for key, value in ask.items())]
        theirs = st.encode([TEXTS[row] for row in rows], batch_size=4, **ask)
        assert_agree(ours[rows], theirs)
    assert ours.shape[1] == st.get_sentence_embedding_dimension()


def test_the_decoder_layout_pads_left_and_names_its_layout(st_model: Any, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kinference.handlers.embedding"):
        handler = set_up(st_model("lasttoken"))
    assert "sentence-transformers" in caplog.text and "pooling lasttoken" in caplog.text
    batch = handler.preprocess(handler.validate_many([{"text": "a"}, {"text": "a much longer text than that"}]))
    mask = batch.tensors["attention_mask"]
    assert mask[0, -1] == 1 and mask[0, 0] == 0  # the short row's padding is on the left


def test_the_device_process_merge_keeps_left_padding(st_model: Any) -> None:
    """Two workers' micro-batches, merged in the device process, give the vectors each would alone."""
    handler = set_up(st_model("lasttoken"))
    first = handler.validate_many([{"text": text} for text in TEXTS[:3]])
    second = handler.validate_many([{"text": text, "prompt_name": "query"} for text in TEXTS[3:]])
    merged = handler.inference(handler.merge([handler.preprocess(first), handler.preprocess(second)]))
    alone = vectors(handler, [{"text": text} for text in TEXTS[:3]] +
                    [{"text": text, "prompt_name": "query"} for text in TEXTS[3:]])
    np.testing.assert_allclose(merged.numpy(), alone, atol=1e-5)


def test_a_plain_transformers_directory_keeps_mean_pooling_normalised(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = build_tiny_classifier(tmp_path / "plain")  # a BERT without modules.json
    with caplog.at_level(logging.INFO, logger="kinference.handlers.embedding"):
        handler = set_up(model)
    assert "no modules.json" in caplog.text and handler.max_length == 256
    ours = vectors(handler, [{"text": text} for text in TEXTS])
    transformer = modules.Transformer(str(model), max_seq_length=256)
    st = SentenceTransformer(modules=[transformer, modules.Pooling(32, "mean"), modules.Normalize()], device="cpu")
    assert_agree(ours, st.encode(TEXTS))


def test_handler_options_override_the_layout(st_model: Any) -> None:
    model = st_model("cls")
    handler = set_up(model, pooling="mean", normalize=False, max_length=32)
    transformer = modules.Transformer(str(model), max_seq_length=32)
    st = SentenceTransformer(modules=[transformer, modules.Pooling(64, "mean")], device="cpu")
    short = [text for text in TEXTS if len(handler.tokenizer(text)["input_ids"]) <= 32]
    assert_agree(vectors(handler, [{"text": text} for text in short]), st.encode(short))


def test_a_text_past_the_limit_is_refused_with_its_own_code_unless_cut(st_model: Any) -> None:
    model = st_model("lasttoken")
    handler, st = set_up(model), reference(model)
    long = " ".join(["stream"] * 300)
    payloads = [{"text": long}, {"text": long, "truncate": True, "prompt_name": "query"}]
    refused, cut_by_request = answers(handler, payloads)
    assert isinstance(refused, InputTooLong) and refused.code == ErrorCode.INPUT_TOO_LONG == "input_too_long"
    assert "302 tokens, more than the limit of 128" in str(refused)
    assert_agree(np.array([vector(cut_by_request["embedding"])]), st.encode([long], prompt_name="query"))
    cut_by_option = set_up(model, truncate=True)
    assert_agree(vectors(cut_by_option, [{"text": long}]), st.encode([long]))


def test_openai_bodies_take_the_same_fields_and_count_the_tokens_embedded(st_model: Any) -> None:
    model = st_model("dense")  # its default prompt is "query: "
    handler, st = set_up(model), reference(model)
    long = " ".join(["kafka"] * 200)
    body = {"input": ["short one", long], "truncate": True, "prompt_name": "passage", "dimensions": 16}
    (reply,) = answers(handler, [body])
    ours = np.array([vector(row["embedding"]) for row in reply["data"]])
    theirs = st.encode(["short one", long], prompt_name="passage", truncate_dim=16, normalize_embeddings=True)
    assert_agree(ours, theirs)
    assert np.linalg.norm(ours, axis=1).tolist() == pytest.approx([1.0, 1.0], abs=1e-5)
    expected = len(st.preprocess(["passage: short one"])["input_ids"][0]) + 128
    assert reply["usage"] == {"prompt_tokens": expected, "total_tokens": expected}
    (refused,) = answers(handler, [{"input": ["fine", long]}])
    assert isinstance(refused, InputTooLong) and str(refused).startswith("input[1]: the text has")
    (defaulted,) = answers(handler, [{"input": "short one"}])
    assert_agree(np.array([vector(defaulted["data"][0]["embedding"])]), st.encode(["short one"]))


def test_bad_request_fields_are_refused_saying_what_is_allowed(st_model: Any) -> None:
    handler = set_up(st_model("dense"))
    outcomes = answers(handler, [{"text": "a", "prompt_name": "nope"}, {"text": "a", "dimensions": 33},
                                 {"text": "a", "dimensions": True}, {"text": "a", "truncate": "yes"},
                                 {"text": "a", "prompt": 7}])
    assert all(isinstance(outcome, InvalidInput) for outcome in outcomes)
    messages = [str(outcome) for outcome in outcomes]
    assert "not one of the model's prompts (document, passage, query)" in messages[0]
    assert "from 1 to 32 (the model's width), not 33" in messages[1] and "not True" in messages[2]
    assert '"truncate" must be true or false' in messages[3] and '"prompt" must be a string' in messages[4]


def test_onnxruntime_serves_a_layout_with_dense_layers(st_model: Any) -> None:
    pytest.importorskip("onnxruntime")
    model = st_model("dense")
    handler = set_up(model, runtime="onnxruntime")
    payloads = [{"text": text} for text in TEXTS]
    assert_agree(vectors(handler, payloads), reference(model).encode(TEXTS))


@pytest.mark.parametrize(("module", "named"), [
    ("sentence_transformers.models.LayerNorm", "LayerNorm"),
    ("sentence_transformers.sentence_transformer.modules.static_embedding.StaticEmbedding", "StaticEmbedding"),
])
def test_a_layout_kinference_cannot_serve_fails_setup_naming_it(
        st_model: Any, tmp_path: Path, module: str, named: str) -> None:
    import shutil

    model = shutil.copytree(st_model("cls"), tmp_path / "model")
    modules = json.loads((model / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_Extra", "type": module})
    (model / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(HandlerLoadError, match=f"module\\(s\\) {named}, which kinference does not serve"):
        set_up(model)


def test_a_transformer_that_reads_chat_messages_fails_setup_saying_so(st_model: Any, tmp_path: Path) -> None:
    import shutil

    model = shutil.copytree(st_model("lasttoken"), tmp_path / "model")
    config = json.loads((model / "sentence_bert_config.json").read_text())
    config["modality_config"]["message"] = {"method": "forward", "method_output_name": "last_hidden_state"}
    (model / "sentence_bert_config.json").write_text(json.dumps(config))
    with pytest.raises(HandlerLoadError, match="modalities text, message, which kinference does not serve"):
        set_up(model)


def test_a_device_process_hands_an_openai_bodys_rows_back_as_one_output(st_model: Any) -> None:
    """Micro-batches of several workers, one holding a three-text body, merged: one output per item, in order."""
    handler = set_up(st_model("cls"))
    first = handler.validate_many([{"text": "alone"}, {"input": TEXTS[:3]}])
    second = handler.validate_many([{"text": "after"}])
    outputs = handler.inference(handler.merge([handler.preprocess(first), handler.preprocess(second)]))
    assert [tuple(output.shape) for output in outputs] == [(1, 64), (3, 64), (1, 64)]
    (body,) = answers(handler, [{"input": TEXTS[:3]}])
    np.testing.assert_allclose(outputs[1].numpy(), [vector(row["embedding"]) for row in body["data"]], atol=1e-5)
