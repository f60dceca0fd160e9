"""The parts shared by the text handlers (handlers/text.py): request checks, options, tokenisation, loading."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from consumer.errors import ErrorCode, HandlerLoadError, InvalidInput
from handlers import HandlerContext, load_handler
from handlers.classification import TextClassificationHandler
from handlers.embedding import EmbeddingHandler
from handlers.text import validate_text
from tests.models import build_tiny_classifier


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        ("hello", 'expected a JSON object like {"text": "..."}, got a string'),
        (["hello"], "got an array"),
        (None, "got null"),
        (3, "got a number"),
        ({}, 'missing "text"'),
        ({"txt": "hello"}, "got keys ['txt']"),
        ({"text": 3.5}, '"text" must be a string, got a number'),
        ({"text": True}, '"text" must be a string, got a boolean'),
        ({"text": None}, '"text" must be a string, got null'),
        ({"text": ["a", "b"]}, '"text" must be a string, got an array'),
        ({"text": ""}, '"text" is empty'),
        ({"text": " \n\t"}, '"text" is empty or only whitespace'),
        ({"text": "x" * 11}, '"text" has 11 characters, more than the limit of 10 (handler option max_chars)'),
    ],
)
def test_validate_rejects_with_a_message_that_says_what_is_wrong(payload: Any, expected: str) -> None:
    with pytest.raises(InvalidInput) as raised:
        validate_text(payload, max_chars=10)
    assert expected in raised.value.message
    assert raised.value.code is ErrorCode.BAD_REQUEST


def test_validate_returns_the_text_unchanged_and_ignores_other_keys() -> None:
    assert validate_text({"text": " ten chars ", "id": 7}, max_chars=11) == " ten chars "


def test_load_handler_resolves_the_builtin_text_handlers() -> None:
    assert type(load_handler("embedding")) is EmbeddingHandler
    assert type(load_handler("text-classification")) is TextClassificationHandler


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_classifier(tmp_path_factory.mktemp("tiny-classifier"))


def set_up(model: Path | None, **options: Any) -> TextClassificationHandler:
    handler = TextClassificationHandler()
    handler.setup(HandlerContext(device="cpu", model=model, options=options))
    return handler


@pytest.mark.model
def test_the_handler_rejects_texts_over_its_max_chars_option(tiny_model: Path) -> None:
    handler = set_up(tiny_model, max_chars=20)
    assert handler.validate({"text": "x" * 20}) == "x" * 20
    with pytest.raises(InvalidInput, match="21 characters, more than the limit of 20"):
        handler.validate({"text": "x" * 21})


@pytest.mark.model
def test_preprocess_pads_to_the_longest_text_and_truncates_at_max_length(tiny_model: Path) -> None:
    handler = set_up(tiny_model, max_length=8)
    inputs = handler.preprocess(["short", "one two three four five six seven eight nine ten"])
    assert inputs["input_ids"].shape == (2, 8)
    assert inputs["attention_mask"].tolist() == [[1, 1, 1, 0, 0, 0, 0, 0], [1] * 8]


@pytest.mark.model
def test_inference_returns_float32_on_the_cpu_whatever_the_model_dtype(tiny_model: Path) -> None:
    handler = set_up(tiny_model, dtype="bfloat16")
    assert handler.model.dtype == torch.bfloat16
    outputs = handler.inference(handler.preprocess(["a bfloat16 model"]))
    assert outputs.dtype == torch.float32
    assert outputs.device.type == "cpu"


@pytest.mark.model
def test_describe_names_the_model_directory_and_device(tiny_model: Path) -> None:
    assert set_up(tiny_model).describe() == {
        "handler": "text-classification",
        "model": tiny_model.name,
        "device": "cpu",
    }


@pytest.mark.model
@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"max_lenght": 64}, "unknown handler option(s) max_lenght; known: max_length, max_chars, dtype, top_k"),
        ({"max_length": 0}, "max_length must be an integer >= 1, not 0"),
        ({"max_length": "64"}, "max_length must be an integer >= 1, not '64'"),
        ({"max_chars": True}, "max_chars must be an integer >= 1, not True"),
        ({"dtype": "float64"}, "dtype must be one of float32, float16, bfloat16"),
        ({"max_length": 1024}, "max_length=1024 is more than the 512 positions of the model"),
    ],
)
def test_bad_options_fail_setup_with_the_fix(tiny_model: Path, options: dict[str, Any], expected: str) -> None:
    with pytest.raises(HandlerLoadError) as raised:
        set_up(tiny_model, **options)
    assert expected in str(raised.value)


def test_a_missing_model_directory_fails_setup(tmp_path: Path) -> None:
    with pytest.raises(HandlerLoadError, match=r"model directory \S+/absent does not exist"):
        set_up(tmp_path / "absent")


@pytest.mark.model
def test_a_directory_without_a_model_fails_setup_without_reaching_for_the_hub(tmp_path: Path) -> None:
    with pytest.raises(HandlerLoadError, match="cannot load the model in"):
        set_up(tmp_path)
