"""Sparse embeddings (SPLADE) from a sentence-transformers ``SparseEncoder``: a weight per vocabulary token.

``--model DIR`` is a ``SparseEncoder`` directory whose ``modules.json`` holds a masked-language model (``Transformer``
with ``fill-mask``, or the older ``MLMTransformer``) and ``SpladePooling``; a plain ``AutoModelForMaskedLM``
directory is read as SPLADE's usual max pooling. The vector of a text is what ``SparseEncoder.encode`` computes: the
MLM head's logits over the real tokens (padding masked), ``log(1 + relu(x))`` (``log1p_relu``: once more ``log1p``),
then the max (or the sum, as the pooling's ``pooling_strategy`` says) over the tokens; with ``max_active_dims``
(saved by the model, or the handler option) only that many largest weights stay.

A request is ``{"text": "..."}``, answered ``{"indices": [...], "values": [...]}`` (the nonzero weights, indices
ascending, as text-embeddings-inference's ``embed_sparse``), or ``{"input": "..." | ["...", ...]}``, answered with
an OpenAI-style list, ``{"object": "list", "data": [{"object": "sparse_embedding", "index": i, "indices": [...],
"values": [...]}, ...], "model": ..., "usage": {...}}``; each text is one row of the batch (handlers/rows.py). A text
past ``max_length`` (default: the model's, as ``SparseEncoder`` reads it) is cut as ``SparseEncoder`` cuts it.

The vocabulary-wide rows stay on the device: only the nonzero weights come back to the host.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForMaskedLM

from kinference.errors import HandlerLoadError
from kinference.handlers.options import positive_int
from kinference.handlers.rows import RowsHandler, Text, read_array, read_object
from kinference.handlers.text import TextHandler, validate_text
from kinference.openai import read_embeddings_request

log = logging.getLogger(__name__)

MASKED_LM_MODULES = ("sentence_transformers.base.modules.transformer.Transformer",
                     "sentence_transformers.sparse_encoder.modules.mlm_transformer.MLMTransformer",
                     "sentence_transformers.sparse_encoder.models.MLMTransformer")
SPLADE_POOLING = ("sentence_transformers.sparse_encoder.modules.splade_pooling.SpladePooling",
                  "sentence_transformers.sparse_encoder.models.SpladePooling")


@dataclass(frozen=True, slots=True)
class Splade:
    """How ``SpladePooling`` turns the logits into one vector: its saved ``pooling_strategy`` and
    ``activation_function``."""

    pooling: str = "max"
    activation: str = "relu"


@dataclass(frozen=True, slots=True)
class SparseRequest:
    listed: bool
    """An ``{"input": ...}`` request: answered with a list."""


class SparseHandler(RowsHandler):
    name = "sparse"
    model_class = AutoModelForMaskedLM
    defaults = {**TextHandler.defaults, "max_length": None, "max_active_dims": None}

    def configure(self, options: dict[str, Any]) -> None:
        self.splade, layout = _splade(self.model_dir)
        saved = read_object(self.model_dir / "config_sentence_transformers.json").get("max_active_dims")
        given = options["max_active_dims"] if options["max_active_dims"] is not None else saved
        self.max_active_dims = None if given is None else positive_int(self.name, "max_active_dims", given)
        log.info("%s: %s: SPLADE %s pooling of %s, max_length %d, max_active_dims %s", self.name, layout,
                 self.splade.pooling, self.splade.activation, self.max_length, self.max_active_dims)

    def read(self, payload: Any) -> tuple[Sequence[Text], SparseRequest]:
        if not isinstance(payload, dict) or "input" not in payload:
            texts = [validate_text(payload, self.max_chars)]
        else:
            texts = [validate_text({"text": text}, self.max_chars) for text in read_embeddings_request(payload).texts]
        prompt = self.prompts.of(payload)
        return [prompt + text for text in texts], SparseRequest(listed="input" in payload)

    def reduce(self, output: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        # SpladePooling's steps, in the model's dtype as it computes them: padding's logits set to 0 (they vanish
        # under relu), log1p(relu), an optional second log1p, then the max or sum over the tokens.
        logits: torch.Tensor = output.logits
        weights = (logits * inputs["attention_mask"].unsqueeze(-1).to(logits.dtype)).relu_().log1p_()
        if self.splade.activation == "log1p_relu":
            weights = weights.log1p_()
        pooled = weights.amax(dim=1) if self.splade.pooling == "max" else weights.sum(dim=1)
        if self.max_active_dims is not None and self.max_active_dims < pooled.shape[1]:
            top = pooled.topk(self.max_active_dims, dim=1)
            pooled = torch.zeros_like(pooled).scatter_(1, top.indices, top.values)
        return pooled

    def to_host(self, rows: torch.Tensor) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each row's nonzero weights, found on the device: (indices ascending, values) per row."""
        nonzero = rows > 0
        counts = nonzero.sum(dim=1).cpu().numpy()
        # nonzero() lists the entries row by row, columns ascending within a row: each row's indices come sorted.
        indices = nonzero.nonzero()[:, 1].to(torch.int32).cpu().numpy()
        values = rows[nonzero].float().cpu().numpy()
        bounds = np.cumsum(counts)[:-1]
        return list(zip(np.split(indices, bounds), np.split(values, bounds), strict=True))

    def answer(self, request: SparseRequest, rows: list[Any], tokens: int) -> dict[str, Any]:
        vectors = [{"indices": indices, "values": values} for indices, values in rows]
        if not request.listed:
            return vectors[0]
        return {"object": "list", "model": self.model_name,
                "data": [{"object": "sparse_embedding", "index": i, **vector} for i, vector in enumerate(vectors)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _splade(model_dir: Path) -> tuple[Splade, str]:
    """The pooling the model's ``modules.json`` names, and which layout was read; SPLADE's max pooling of
    ``log1p(relu)`` for a plain masked-LM directory. A module this handler does not compute fails setup, named."""
    modules = [module for module in read_array(model_dir / "modules.json") if isinstance(module, dict)]
    if not modules:
        return Splade(), "a plain masked-LM directory (no modules.json)"
    kinds = [str(module.get("type")) for module in modules]
    if len(kinds) != 2 or kinds[0] not in MASKED_LM_MODULES or kinds[1] not in SPLADE_POOLING:
        raise HandlerLoadError(f"sparse: {model_dir}/modules.json lists {', '.join(kinds)}; the sparse handler "
                               "computes a masked-LM Transformer followed by SpladePooling only")
    config = read_object(model_dir / str(modules[1].get("path", "")) / "config.json")
    splade = Splade(config.get("pooling_strategy", "max"), config.get("activation_function", "relu"))
    if splade.pooling not in ("max", "sum") or splade.activation not in ("relu", "log1p_relu"):
        raise HandlerLoadError(f"sparse: unknown SpladePooling settings in {model_dir}: {config}")
    return splade, "a sentence-transformers SparseEncoder (modules.json)"

