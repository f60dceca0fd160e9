"""What the transformers text handlers share: the ``{"text": str}`` request, options, loading, the forward pass.

A subclass names the transformers ``Auto`` class to load and implements ``reduce`` (model output -> one
row per item) and ``postprocess`` (row -> JSON result); everything else lives here once.
"""

from __future__ import annotations

from abc import abstractmethod
from pathlib import Path
from typing import Any, ClassVar

import torch
from transformers import AutoTokenizer, BatchEncoding

from consumer.errors import HandlerLoadError, InvalidInput
from handlers.base import Handler, HandlerContext

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}


def validate_text(payload: Any, max_chars: int) -> str:
    """Return the text of a ``{"text": "..."}`` request; raise ``InvalidInput`` saying what to send instead."""
    if not isinstance(payload, dict):
        raise InvalidInput(f'expected a JSON object like {{"text": "..."}}, got {_json_type(payload)}')
    if "text" not in payload:
        raise InvalidInput(f'missing "text": expected {{"text": "..."}}, got keys {sorted(payload)}')
    text = payload["text"]
    if not isinstance(text, str):
        raise InvalidInput(f'"text" must be a string, got {_json_type(text)}')
    if not text.strip():
        raise InvalidInput('"text" is empty or only whitespace')
    if len(text) > max_chars:
        raise InvalidInput(
            f'"text" has {len(text)} characters, more than the limit of {max_chars} (handler option max_chars)'
        )
    return text


def _json_type(value: Any) -> str:
    return _JSON_TYPES.get(type(value), "a number" if isinstance(value, int | float) else type(value).__name__)


def positive_int(handler: str, key: str, value: Any) -> int:
    # bool is an int subclass: top_k=true must not read as 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HandlerLoadError(f"{handler}: handler option {key} must be an integer >= 1, not {value!r}")
    return value


class TextHandler(Handler):
    """Base of the handlers that run a transformers model on ``{"text": str}`` requests.

    Options (``--handler-option key=value``): ``max_length`` (tokens kept per text, default 256),
    ``max_chars`` (longer requests are rejected, default 20000), ``dtype`` (float32, float16 or bfloat16),
    plus each subclass's own ``defaults``.
    """

    model_class: ClassVar[Any]
    """The transformers ``Auto`` class that loads the model, e.g. ``AutoModel``."""

    defaults: ClassVar[dict[str, Any]] = {"max_length": 256, "max_chars": 20_000, "dtype": "float32"}
    """Every option the handler knows, with its default; anything else is a typo and fails setup."""

    def setup(self, context: HandlerContext) -> None:
        options = self._options(context.options)
        self.max_chars = positive_int(self.name, "max_chars", options["max_chars"])
        self.max_length = positive_int(self.name, "max_length", options["max_length"])
        if options["dtype"] not in DTYPES:
            raise HandlerLoadError(f"{self.name}: handler option dtype must be one of {', '.join(DTYPES)}")
        if context.model is None:
            self.model_name, model_dir = self.default_model()
        else:
            self.model_name, model_dir = context.model.resolve().name, context.model
        self.device = torch.device(context.device)
        self._load(model_dir, DTYPES[options["dtype"]])
        positions = getattr(self.model.config, "max_position_embeddings", None)
        if positions is not None and self.max_length > positions:
            raise HandlerLoadError(
                f"{self.name}: max_length={self.max_length} is more than the {positions} positions of the model"
            )
        self.configure(options)

    def default_model(self) -> tuple[str, Path]:
        """Name and directory of the model used without ``--model``."""
        raise HandlerLoadError(f"{self.name} needs --model <local dir>")

    def configure(self, options: dict[str, Any]) -> None:
        """Read the subclass's own options; the model is loaded by then."""

    def _options(self, given: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(given) - set(self.defaults))
        if unknown:
            raise HandlerLoadError(
                f"{self.name}: unknown handler option(s) {', '.join(unknown)}; known: {', '.join(self.defaults)}"
            )
        return {**self.defaults, **given}

    def _load(self, model_dir: Path, dtype: torch.dtype) -> None:
        if not model_dir.is_dir():
            raise HandlerLoadError(f"{self.name}: model directory {model_dir} does not exist")
        # local_files_only: a directory without the files must fail here, not reach for the model hub.
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
            model = self.model_class.from_pretrained(model_dir, local_files_only=True, dtype=dtype)
            self.model = model.eval().to(self.device)
        except Exception as exc:  # whatever fails while loading, the service cannot start
            raise HandlerLoadError(f"{self.name}: cannot load the model in {model_dir}: {exc}") from exc

    def validate(self, payload: Any) -> str:
        return validate_text(payload, self.max_chars)

    def preprocess(self, items: list[str]) -> BatchEncoding:
        return self.tokenizer(items, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")

    def warm_up(self) -> None:
        self.inference(self.preprocess(["warm up"]))

    def token_counts(self, inputs: BatchEncoding) -> tuple[int, int]:
        mask = inputs["attention_mask"]
        return int(mask.sum()), mask.numel()

    def inference(self, inputs: BatchEncoding) -> torch.Tensor:
        inputs = inputs.to(self.device)
        with torch.inference_mode():
            output = self.model(**inputs)
            return self.reduce(output, inputs).float().cpu()

    @abstractmethod
    def reduce(self, output: Any, inputs: BatchEncoding) -> torch.Tensor:
        """Turn the model output into one row per item (still on the device)."""

    def describe(self) -> dict[str, str]:
        return {"handler": self.name, "model": self.model_name, "device": str(self.device)}
