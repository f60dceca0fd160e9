"""The text-classification handler, on a tiny random BERT classifier built by tests/models.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from kinference.errors import HandlerLoadError
from kinference.handlers import HandlerContext
from kinference.handlers.classification import TextClassificationHandler
from tests.models import TINY_LABELS, build_tiny_classifier

pytestmark = pytest.mark.model

TEXTS = [
    "I loved every minute of it",
    "no",
    "The delivery was late, the box was damaged and nobody answered the phone for a week.",
    "fine I guess",
    "an absolutely wonderful, heart-warming film that I would happily watch again tomorrow",
]


@pytest.fixture(scope="module")
def single_label(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_classifier(tmp_path_factory.mktemp("single-label"))


@pytest.fixture(scope="module")
def multi_label(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_classifier(tmp_path_factory.mktemp("multi-label"), multi_label=True)


def set_up(model: Path | None, **options: Any) -> TextClassificationHandler:
    handler = TextClassificationHandler()
    handler.setup(HandlerContext(device="cpu", model=model, options=options))
    return handler


def classify(handler: TextClassificationHandler, texts: list[str]) -> list[dict[str, float]]:
    """Run the handler's three steps; return each result as {label: score}, checking the order on the way."""
    items = [handler.validate({"text": text}) for text in texts]
    results = handler.postprocess(handler.inference(handler.preprocess(items)), items)
    scores = []
    for result in results:
        listed = [entry["score"] for entry in result["labels"]]
        assert listed == sorted(listed, reverse=True)
        scores.append({entry["label"]: entry["score"] for entry in result["labels"]})
    return scores


def model_scores(model_dir: Path, texts: list[str], activation: str) -> list[dict[str, float]]:
    """The reference: the model called directly, one text at a time."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, local_files_only=True).eval()
    expected = []
    with torch.no_grad():
        for text in texts:
            logits = model(**tokenizer(text, return_tensors="pt")).logits[0]
            probabilities = logits.softmax(dim=-1) if activation == "softmax" else logits.sigmoid()
            expected.append({TINY_LABELS[i]: p for i, p in enumerate(probabilities.tolist())})
    return expected


def assert_close(actual: list[dict[str, float]], expected: list[dict[str, float]]) -> None:
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected, strict=True):
        assert got.keys() == want.keys()
        assert max(abs(got[label] - want[label]) for label in want) < 1e-5


def test_scores_are_the_softmax_of_the_logits_under_the_config_labels(single_label: Path) -> None:
    results = classify(set_up(single_label), TEXTS)
    assert_close(results, model_scores(single_label, TEXTS, "softmax"))
    for scores in results:
        assert set(scores) == {"neg", "neu", "pos"}
        assert sum(scores.values()) == pytest.approx(1.0, abs=1e-6)


def test_a_multi_label_model_gets_independent_sigmoid_scores(multi_label: Path) -> None:
    results = classify(set_up(multi_label), TEXTS)
    assert_close(results, model_scores(multi_label, TEXTS, "sigmoid"))
    assert any(abs(sum(scores.values()) - 1.0) > 0.05 for scores in results)


def test_top_k_keeps_the_best_labels(single_label: Path) -> None:
    everything = classify(set_up(single_label), TEXTS)
    best = classify(set_up(single_label, top_k=1), TEXTS)
    for all_scores, top in zip(everything, best, strict=True):
        assert list(top) == [max(all_scores, key=all_scores.__getitem__)]


def test_a_result_does_not_depend_on_the_rest_of_its_batch(single_label: Path) -> None:
    handler = set_up(single_label)
    alone = [score for text in TEXTS for score in classify(handler, [text])]
    assert_close(classify(handler, TEXTS), alone)


def test_without_model_setup_says_to_pass_one() -> None:
    with pytest.raises(HandlerLoadError, match="text-classification needs --model <local dir>"):
        set_up(None)


@pytest.mark.parametrize(
    ("top_k", "expected"),
    [
        (0, "top_k must be an integer >= 1, not 0"),
        (-2, "top_k must be an integer >= 1, not -2"),
        (1.5, "top_k must be an integer >= 1, not 1.5"),
        ("two", "top_k must be an integer >= 1, not 'two'"),
        (True, "top_k must be an integer >= 1, not True"),
        (4, "top_k=4 but the model has 3 labels"),
    ],
)
def test_a_bad_top_k_fails_setup(single_label: Path, top_k: Any, expected: str) -> None:
    with pytest.raises(HandlerLoadError) as raised:
        set_up(single_label, top_k=top_k)
    assert expected in str(raised.value)
