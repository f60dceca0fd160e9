"""The parts shared by the text handlers (handlers/text.py): request checks, options, tokenisation, collation,
shape buckets, AMP and compiling, loading."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch._dynamo import register_backend
from transformers import AutoTokenizer

from kinference.errors import HandlerLoadError, InvalidInput
from kinference.handlers import HandlerContext, load_handler
from kinference.handlers.classification import TextClassificationHandler
from kinference.handlers.embedding import EmbeddingHandler
from kinference.handlers.text import TextBatch, TextItem, validate_text
from kinference.protocol import ErrorCode
from tests.models import build_tiny_classifier, varied_texts


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


def set_up(model: Path | None, max_batch_size: int = 32, **options: Any) -> TextClassificationHandler:
    handler = TextClassificationHandler()
    handler.setup(HandlerContext(device="cpu", model=model, options=options, max_batch_size=max_batch_size))
    return handler


def preprocess(handler: TextClassificationHandler, texts: list[str]) -> TextBatch:
    return handler.preprocess([handler.validate({"text": text}) for text in texts])


def scores(handler: TextClassificationHandler, texts: list[str]) -> torch.Tensor:
    """The class probabilities of ``texts``, one row each."""
    return handler.inference(preprocess(handler, texts))


@pytest.mark.model
def test_the_handler_rejects_texts_over_its_max_chars_option(tiny_model: Path) -> None:
    handler = set_up(tiny_model, max_chars=20)
    assert handler.validate({"text": "x" * 20}).text == "x" * 20
    with pytest.raises(InvalidInput, match="21 characters, more than the limit of 20"):
        handler.validate({"text": "x" * 21})


@pytest.mark.model
def test_preprocess_pads_to_the_longest_text_and_truncates_at_max_length(tiny_model: Path) -> None:
    handler = set_up(tiny_model, max_length=8)
    inputs = preprocess(handler, ["short", "one two three four five six seven eight nine ten"]).tensors
    assert inputs["input_ids"].shape == (2, 8)
    assert inputs["attention_mask"].tolist() == [[1, 1, 1, 0, 0, 0, 0, 0], [1] * 8]


@pytest.mark.model
def test_inference_returns_float32_on_the_cpu_whatever_the_model_dtype(tiny_model: Path) -> None:
    handler = set_up(tiny_model, dtype="bfloat16")
    assert handler.model.dtype == torch.bfloat16
    outputs = scores(handler, ["a bfloat16 model"])
    assert outputs.dtype == torch.float32
    assert outputs.device.type == "cpu"


@pytest.mark.model
def test_describe_names_the_model_directory_and_device(tiny_model: Path) -> None:
    assert set_up(tiny_model).describe() == {
        "handler": "text-classification",
        "model": tiny_model.name,
        "device": "cpu",
        "amp": "none",
        "compile": "off",
        "cuda_graphs": "off",
        "shape_buckets": "off",
        "runtime": "torch",
    }


@pytest.mark.model
@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (
            {"max_lenght": 64},
            "unknown handler option(s) max_lenght; known: max_length, max_chars, dtype, amp, compile, compile_backend, "
            "cuda_graphs, shape_buckets, runtime, quantize, calibration_corpus, truncate, top_k",
        ),
        ({"max_length": 0}, "max_length must be an integer >= 1, not 0"),
        ({"max_length": "64"}, "max_length must be an integer >= 1, not '64'"),
        ({"max_chars": True}, "max_chars must be an integer >= 1, not True"),
        ({"dtype": "float64"}, "dtype must be one of auto, float32, float16, bfloat16, not 'float64'"),
        ({"amp": "float16"}, "amp=float16 needs a GPU; on the CPU use amp=bfloat16"),
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


def test_a_model_hub_id_fails_setup_with_how_to_fetch_it() -> None:
    with pytest.raises(HandlerLoadError, match=r"looks like a model hub id.*huggingface-cli download acme/absent"):
        set_up(Path("acme/absent"))


def test_a_directory_without_a_model_names_every_missing_piece_without_reaching_for_the_hub(tmp_path: Path) -> None:
    with pytest.raises(HandlerLoadError) as raised:
        set_up(tmp_path)
    assert "lacks config.json" in str(raised.value) and "the weights (model.safetensors or pytorch_model.bin)" in str(
        raised.value) and "the tokenizer (tokenizer.json)" in str(raised.value)


@pytest.mark.model
@pytest.mark.parametrize(("removed", "named"), [("config.json", "config.json"), ("model.safetensors", "the weights"),
                                                 ("tokenizer*", "the tokenizer")])
def test_a_model_directory_missing_one_piece_names_it(tmp_path: Path, removed: str, named: str) -> None:
    model = build_tiny_classifier(tmp_path)
    for path in [*model.glob(removed), *(model.glob("vocab.txt") if removed == "tokenizer*" else [])]:
        path.unlink()
    with pytest.raises(HandlerLoadError, match=f"lacks {named}"):
        set_up(model)


@pytest.mark.model
def test_a_directory_whose_files_do_not_load_fails_setup(tmp_path: Path) -> None:
    model = build_tiny_classifier(tmp_path)
    (model / "config.json").write_text("{not json")
    with pytest.raises(HandlerLoadError, match="cannot load the model in"):
        set_up(model)


@pytest.mark.model
def test_validate_tokenises_once_and_cost_is_the_token_count_after_truncation(tiny_model: Path) -> None:
    handler = set_up(tiny_model, max_length=8)
    short = handler.validate({"text": "short"})
    assert short == TextItem("short", [101, 2460, 102], [0, 0, 0])  # [CLS] short [SEP]
    assert handler.cost(short) == 3
    assert handler.cost(handler.validate({"text": "one two three four five six seven eight nine ten"})) == 8


@pytest.mark.model
def test_collation_equals_the_tokenizers_own_padded_batch(tiny_model: Path) -> None:
    handler = set_up(tiny_model, max_length=64)
    # Accents, word pieces, a special token typed in the text, and one text cut at max_length.
    texts = [*varied_texts(14, max_words=40), "a [SEP] inside", " ".join(["kafka"] * 100)]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model, local_files_only=True)
    expected = tokenizer(texts, padding=True, truncation=True, max_length=64, return_tensors="pt")
    batch = preprocess(handler, texts)
    assert set(batch.tensors) == set(expected) == {"input_ids", "token_type_ids", "attention_mask"}
    for name, tensor in expected.items():
        assert torch.equal(batch.tensors[name], tensor), name
    assert batch.tensors["input_ids"].shape == (16, 64)
    assert handler.token_counts(batch) == (int(expected["attention_mask"].sum()), 16 * 64)


@pytest.mark.model
def test_a_poll_tokenised_at_once_gives_the_items_of_each_text_tokenised_alone(tiny_model: Path) -> None:
    # validate_many tokenises without character offsets (encode_batch_fast): the ids must not change with that.
    handler = set_up(tiny_model, max_length=64)
    texts = [*varied_texts(14, max_words=40), "a [SEP] inside", "Crème brûlée, naïve café", " ".join(["kafka"] * 100)]
    payloads: list[Any] = [{"text": text} for text in texts]
    payloads.insert(3, {"txt": "rejected alone"})
    items = handler.validate_many(payloads)
    assert isinstance(items.pop(3), InvalidInput)
    assert items == [handler.validate({"text": text}) for text in texts]


SHORT_AND_LONG = ["no", "fine I guess", " ".join(["stream"] * 20), "the cat sat on the mat " * 4]
"""2 texts in the 16-token bucket, 2 in the 32-token one."""


@pytest.mark.model
@pytest.mark.parametrize(("count", "rows"), [(1, 1), (3, 4), (5, 8)])
def test_shape_buckets_pad_the_batch_but_return_exactly_the_real_rows(tiny_model: Path, count: int, rows: int) -> None:
    bucketed = set_up(tiny_model, max_batch_size=8, max_length=64, shape_buckets=True)
    texts = (SHORT_AND_LONG * 2)[:count]
    batch = preprocess(bucketed, texts)
    assert batch.tensors["input_ids"].shape == (rows, 16 if count == 1 else 32)
    assert not batch.tensors["attention_mask"][count:].any()
    real = sum(bucketed.cost(bucketed.validate({"text": text})) for text in texts)
    assert bucketed.token_counts(batch) == (real, batch.tensors["input_ids"].numel())
    outputs = bucketed.inference(batch)
    torch.testing.assert_close(outputs, scores(set_up(tiny_model, max_length=64), texts))
    assert len(bucketed.postprocess(outputs, [bucketed.validate({"text": text}) for text in texts])) == count


@pytest.mark.model
def test_bfloat16_amp_returns_float32_close_to_full_precision(tiny_model: Path) -> None:
    amp = set_up(tiny_model, amp="bfloat16")
    amp.warm_up()
    full, reduced = scores(set_up(tiny_model), SHORT_AND_LONG), scores(amp, SHORT_AND_LONG)
    assert reduced.dtype == torch.float32
    assert not torch.equal(reduced, full)  # autocast was on
    torch.testing.assert_close(reduced, full, atol=2e-2, rtol=0)


@pytest.fixture(scope="module")
def compiled_shapes() -> list[set[tuple[int, ...]]]:
    """Register a torch.compile backend that runs graphs as they are and records each graph's 2-D int inputs."""
    compiled: list[set[tuple[int, ...]]] = []

    def record(graph: torch.fx.GraphModule, inputs: list[Any]) -> Any:
        compiled.append({tuple(t.shape) for t in inputs if isinstance(t, torch.Tensor) and t.dtype == torch.int64})
        return graph.forward

    register_backend(record, name="kinference_test_recorder")
    return compiled


@pytest.mark.model
def test_warm_up_compiles_every_bucket_shape_so_serving_compiles_nothing(
    tiny_model: Path, compiled_shapes: list[set[tuple[int, ...]]]
) -> None:
    handler = set_up(tiny_model, max_batch_size=2, max_length=32, compile=True,
                     compile_backend="kinference_test_recorder")
    assert handler.describe()["compile"] == "kinference_test_recorder"
    buckets = handler.accelerator.buckets
    assert buckets is not None
    assert buckets.all() == [(1, 16), (1, 32), (2, 16), (2, 32)]
    handler.warm_up()
    assert set(buckets.all()) <= set().union(*compiled_shapes)
    compiled = len(compiled_shapes)
    eager = set_up(tiny_model, max_length=32)
    for size in (1, 2):
        for start in range(0, len(SHORT_AND_LONG), size):
            texts = SHORT_AND_LONG[start : start + size]
            torch.testing.assert_close(scores(handler, texts), scores(eager, texts))
    assert len(compiled_shapes) == compiled


@pytest.mark.model
@pytest.mark.slow
def test_inductor_compiles_the_model_to_the_same_results(tiny_model: Path) -> None:
    # About 30 s on two CPU cores with a cold inductor cache (C++ builds), a few seconds with a warm one.
    handler = set_up(tiny_model, max_batch_size=2, max_length=16, compile=True)
    handler.warm_up()
    texts = SHORT_AND_LONG[:2]
    torch.testing.assert_close(scores(handler, texts), scores(set_up(tiny_model, max_length=16), texts))


@pytest.mark.model
def test_a_tokenizer_without_a_pad_token_fails_setup(tmp_path: Path) -> None:
    model = build_tiny_classifier(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(model)
    with pytest.raises(HandlerLoadError, match=r"has no pad token to pad batches with: set one.*tokenizer.pad_token ="):
        set_up(model)
