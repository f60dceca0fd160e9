"""The rerank handler against sentence-transformers' own ``CrossEncoder.rank``, on tiny random cross-encoders."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kinference.errors import HandlerLoadError, InvalidInput
from kinference.handlers import HandlerContext
from kinference.handlers.rerank import RerankHandler
from tests.models import build_tiny_classifier, build_tiny_cross_encoder, varied_texts

# The reference: the `reference` extra, 6.2 (the lowest-versions run has 5.7, which the bundled MiniLM brings, on an
# older transformers: a tiny model initialises otherwise there, and these tests are for the reference they name).
pytest.importorskip("sentence_transformers", minversion="6.2",
                    reason="sentence-transformers 6.2 (pip install 'kinference[reference]') is the reference these "
                    "tests compare with")

pytestmark = pytest.mark.model

QUERY = "which partition holds the offset of the batch?"
# One word to past the model's 128 positions: a batch whose rows pad a lot, and pairs that CrossEncoder truncates.
DOCUMENTS = ["kafka", *varied_texts(6, seed=7, max_words=40), " ".join(["the broker sat on the mat"] * 40)]


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_cross_encoder(tmp_path_factory.mktemp("cross-encoder"))


def set_up(model: Path, max_batch_size: int = 32, **options: Any) -> RerankHandler:
    handler = RerankHandler()
    handler.setup(HandlerContext(device="cpu", model=model, options=options, max_batch_size=max_batch_size))
    return handler


def serve(handler: RerankHandler, payloads: list[Any]) -> list[Any]:
    """The handler's steps as the service runs them, every payload's pairs in one micro-batch."""
    items = handler.validate_many(payloads)
    return handler.postprocess(handler.inference(handler.preprocess(items)), items)


def reference(model: Path, query: str, documents: list[str], **options: Any) -> list[dict[str, Any]]:
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(model), device="cpu", local_files_only=True).rank(query, documents, **options)


def assert_ranked_as(reply: dict[str, Any], expected: list[dict[str, Any]]) -> None:
    assert [result["index"] for result in reply["results"]] == [entry["corpus_id"] for entry in expected]
    for result, entry in zip(reply["results"], expected, strict=True):
        assert result["relevance_score"] == pytest.approx(entry["score"], abs=1e-4)


@pytest.mark.parametrize(("max_batch_size", "options"), [
    (32, {}),
    (3, {"shape_buckets": True}),  # the pairs run in parts of 3 rows, each padded to a bucket shape
    (32, {"runtime": "onnxruntime"}),
], ids=["eager", "parts-of-3-bucketed", "onnxruntime"])
def test_scores_equal_cross_encoder_rank_with_documents_of_very_different_lengths(
    cross_encoder: Path, max_batch_size: int, options: dict[str, Any]
) -> None:
    handler = set_up(cross_encoder, max_batch_size, **options)
    assert handler.max_length == 128  # CrossEncoder's: the tokenizer's 512, capped at the model's positions
    (reply,) = serve(handler, [{"query": QUERY, "documents": DOCUMENTS}])
    assert_ranked_as(reply, reference(cross_encoder, QUERY, DOCUMENTS))
    assert reply["usage"]["total_tokens"] == handler.cost(handler.validate({"query": QUERY, "documents": DOCUMENTS}))


def test_two_requests_share_a_batch_and_each_gets_its_own_ranking(cross_encoder: Path) -> None:
    handler = set_up(cross_encoder)
    other_query, other_documents = "a blue river", [*DOCUMENTS[3:], "music on the stream"]
    items = handler.validate_many([{"query": QUERY, "documents": DOCUMENTS},
                                   {"query": other_query, "documents": other_documents}])
    batch = handler.preprocess(items)
    assert len(batch.parts) == 1 and batch.parts[0].real_rows == len(DOCUMENTS) + len(other_documents)
    first, second = handler.postprocess(handler.inference(batch), items)
    assert_ranked_as(first, reference(cross_encoder, QUERY, DOCUMENTS))
    assert_ranked_as(second, reference(cross_encoder, other_query, other_documents))


def test_top_n_and_return_documents(cross_encoder: Path) -> None:
    handler = set_up(cross_encoder)
    (reply,) = serve(handler, [{"query": QUERY, "documents": DOCUMENTS, "top_n": 3, "return_documents": True}])
    expected = reference(cross_encoder, QUERY, DOCUMENTS, top_k=3, return_documents=True)
    assert_ranked_as(reply, expected)
    assert [result["document"] for result in reply["results"]] == [{"text": entry["text"]} for entry in expected]
    (plain,) = serve(handler, [{"query": QUERY, "documents": DOCUMENTS[:2], "top_n": 5}])
    assert len(plain["results"]) == 2 and all("document" not in result for result in plain["results"])


def test_a_plain_transformers_directory_scores_as_cross_encoder_does(tmp_path: Path) -> None:
    model = build_tiny_cross_encoder(tmp_path, sentence_transformers=False, seed=3)
    assert not (model / "modules.json").exists()
    (reply,) = serve(set_up(model), [{"query": QUERY, "documents": DOCUMENTS}])
    assert_ranked_as(reply, reference(model, QUERY, DOCUMENTS))


def test_a_saved_identity_activation_gives_the_raw_logits(tmp_path: Path) -> None:
    model = build_tiny_cross_encoder(tmp_path, seed=5)
    settings = model / "config_sentence_transformers.json"
    saved = json.loads(settings.read_text())
    settings.write_text(json.dumps({**saved, "activation_fn": "torch.nn.modules.linear.Identity"}))
    (reply,) = serve(set_up(model), [{"query": QUERY, "documents": DOCUMENTS}])
    expected = reference(model, QUERY, DOCUMENTS)
    assert_ranked_as(reply, expected)
    assert any(not 0 <= entry["score"] <= 1 for entry in expected)  # logits, not sigmoid scores


def test_the_device_process_path_merges_workers_batches_and_answers_one_entry_per_request(cross_encoder: Path) -> None:
    host = RerankHandler()
    host.setup(HandlerContext(device="cpu", model=cross_encoder, role="host"))
    device = set_up(cross_encoder, max_batch_size=4, shape_buckets=True)
    first = host.validate_many([{"query": QUERY, "documents": DOCUMENTS}])
    second = host.validate_many([{"query": "blue", "documents": ["a", "blue river"]},
                                 {"query": "x", "documents": ["y"]}])
    outputs = device.inference(device.merge([host.preprocess(first), host.preprocess(second)]))
    assert len(outputs) == 3  # one entry per request, as the device process hands rows back per item
    replies = host.postprocess(outputs[:1], first) + host.postprocess(outputs[1:], second)
    assert_ranked_as(replies[0], reference(cross_encoder, QUERY, DOCUMENTS))
    assert_ranked_as(replies[1], reference(cross_encoder, "blue", ["a", "blue river"]))
    assert_ranked_as(replies[2], reference(cross_encoder, "x", ["y"]))


def test_the_cost_of_a_request_is_the_tokens_of_all_its_pairs(cross_encoder: Path) -> None:
    handler = set_up(cross_encoder)
    item = handler.validate({"query": "a", "documents": ["b", "c d", " ".join(["mat"] * 500)]})
    # [CLS] a [SEP] b [SEP] = 5, [CLS] a [SEP] c d [SEP] = 6, and the long one cut at the model's 128.
    assert handler.cost(item) == 5 + 6 + 128


@pytest.mark.parametrize(("payload", "expected"), [
    ("a query", "expected a JSON object"),
    ({"documents": ["a"]}, 'missing "query"'),
    ({"query": "  ", "documents": ["a"]}, '"query" must be a non-empty string'),
    ({"query": 3, "documents": ["a"]}, '"query" must be a non-empty string'),
    ({"query": "q"}, '"documents" must be a non-empty array of strings'),
    ({"query": "q", "documents": []}, '"documents" must be a non-empty array of strings'),
    ({"query": "q", "documents": "a"}, '"documents" must be a non-empty array of strings'),
    ({"query": "q", "documents": ["a", 3]}, '"documents"[1] must be a string, got int'),
    ({"query": "q", "documents": ["a"], "top_n": 0}, '"top_n" must be an integer >= 1, not 0'),
    ({"query": "q", "documents": ["a"], "top_n": True}, '"top_n" must be an integer >= 1, not True'),
    ({"query": "q", "documents": ["a"], "return_documents": "yes"}, '"return_documents" must be true or false'),
    ({"query": "q", "documents": ["a"] * 4}, '"documents" holds 4 documents, more than the limit of 3 '
                                             "(handler option max_documents)"),
    ({"query": "q", "documents": ["a", "b" * 30]}, '"documents"[1] has 30 characters, more than the limit of 20'),
])
def test_bad_requests_are_refused_with_what_is_wrong(cross_encoder: Path, payload: Any, expected: str) -> None:
    handler = set_up(cross_encoder, max_documents=3, max_chars=20)
    with pytest.raises(InvalidInput, match=expected.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        handler.validate(payload)
    (result,) = handler.validate_many([payload])  # as the poll thread validates: the error, not a raise
    assert isinstance(result, InvalidInput)


def test_a_classifier_of_several_labels_is_refused_at_setup(tmp_path: Path) -> None:
    with pytest.raises(HandlerLoadError, match="3 labels; a reranker has one"):
        set_up(build_tiny_classifier(tmp_path))


def test_rerank_needs_a_model_directory() -> None:
    with pytest.raises(HandlerLoadError, match="rerank needs --model"):
        RerankHandler().setup(HandlerContext(device="cpu"))


def test_the_models_prompts_mixed_in_one_batch_equal_cross_encoder_rank_with_them(tmp_path: Path) -> None:
    model = build_tiny_cross_encoder(tmp_path, seed=9)
    settings = model / "config_sentence_transformers.json"
    prompts = {"query": "query: ", "judge": "Judge the relevance of this passage: "}
    settings.write_text(json.dumps({**json.loads(settings.read_text()), "prompts": prompts,
                                    "default_prompt_name": "query"}))
    handler = set_up(model)
    replies = serve(handler, [{"query": QUERY, "documents": DOCUMENTS},
                              {"query": QUERY, "documents": DOCUMENTS, "prompt_name": "judge"},
                              {"query": QUERY, "documents": DOCUMENTS, "prompt": "rank: "}])
    assert_ranked_as(replies[0], reference(model, QUERY, DOCUMENTS))  # the default prompt
    assert_ranked_as(replies[1], reference(model, QUERY, DOCUMENTS, prompt_name="judge"))
    assert_ranked_as(replies[2], reference(model, QUERY, DOCUMENTS, prompt="rank: "))
    assert replies[0]["results"] != replies[1]["results"]  # the prompt changed the scores: the test can tell
    with pytest.raises(InvalidInput, match="\"prompt_name\" 'passage' is not one of the model's prompts"):
        handler.validate({"query": QUERY, "documents": ["a"], "prompt_name": "passage"})
    with pytest.raises(InvalidInput, match='give "prompt" or "prompt_name", not both'):
        handler.validate({"query": QUERY, "documents": ["a"], "prompt_name": "judge", "prompt": "x"})


def test_dtype_auto_compares_precisions_on_pairs(cross_encoder: Path) -> None:
    # What dtype=auto does on CUDA at setup, run here on the CPU: the warm-up rows are query-document pairs.
    handler = set_up(cross_encoder)
    assert len(handler.sample_rows(16)) == 16
    _, dtype = handler._reduced_precision(handler.model)
    assert dtype in (torch.float16, torch.bfloat16, torch.float32)


def test_a_query_far_past_the_limit_scores_as_cross_encoder_scores_it_whole(cross_encoder: Path) -> None:
    handler = set_up(cross_encoder)
    query = " ".join(varied_texts(40, seed=5, max_words=60))  # about 1,300 words: 10 times what a pair can keep
    documents = [*DOCUMENTS, query + " and then some more"]  # one document longer than the query
    assert len(handler._usable(query, documents)) < len(query) / 4  # tokenised in each pair: a part of it
    item = handler.validate({"query": query, "documents": documents})
    # Each pair was tokenised from the query's first words only, and is what the whole query gives: the document
    # past the limit but shorter than the query still gets the smaller half of a pair cut in two, the one longer
    # than the query the larger.
    assert all(len(row.input_ids) == 128 for row in item.rows)
    (reply,) = serve(handler, [{"query": query, "documents": documents}])
    assert_ranked_as(reply, reference(cross_encoder, query, documents))


def test_the_max_length_a_cross_encoder_was_saved_with_cuts_the_pairs(tmp_path: Path) -> None:
    from sentence_transformers import CrossEncoder

    plain = build_tiny_cross_encoder(tmp_path / "plain", sentence_transformers=False, seed=4)
    CrossEncoder(str(plain), max_length=64, device="cpu").save(str(tmp_path / "saved"))  # in tokenizer_config.json
    handler = set_up(tmp_path / "saved")
    assert handler.max_length == 64
    (reply,) = serve(handler, [{"query": QUERY, "documents": DOCUMENTS}])
    assert_ranked_as(reply, reference(tmp_path / "saved", QUERY, DOCUMENTS))
    settings = tmp_path / "saved" / "sentence_bert_config.json"  # the older place: sentence_bert_config.json
    settings.write_text(json.dumps({**json.loads(settings.read_text()), "max_seq_length": 48}))
    assert set_up(tmp_path / "saved").max_length == 48 == CrossEncoder(str(tmp_path / "saved")).max_seq_length
