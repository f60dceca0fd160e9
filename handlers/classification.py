"""Text classification with any local ``AutoModelForSequenceClassification`` directory (``--model``).

Each result lists labels (from the model's ``id2label``) with scores, best first: softmax scores, or
independent sigmoid scores when the model is ``multi_label_classification``. Option ``top_k`` keeps
only the best k labels (default: all).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForSequenceClassification

from kinference.errors import HandlerLoadError
from kinference.handlers.labels import top_labels
from kinference.handlers.options import positive_int
from kinference.handlers.text import TextHandler, TextItem


class TextClassificationHandler(TextHandler):
    name = "text-classification"
    model_class = AutoModelForSequenceClassification
    defaults = {**TextHandler.defaults, "top_k": None}

    def configure(self, options: dict[str, Any]) -> None:
        config = self.config
        self.labels = [config.id2label[i] for i in range(config.num_labels)]
        self.multi_label = config.problem_type == "multi_label_classification"
        top_k = options["top_k"]
        self.top_k = len(self.labels) if top_k is None else positive_int(self.name, "top_k", top_k)
        if self.top_k > len(self.labels):
            raise HandlerLoadError(
                f"text-classification: top_k={self.top_k} but the model has {len(self.labels)} labels"
            )

    def reduce(self, output: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        logits: torch.Tensor = output.logits.float()
        return logits.sigmoid() if self.multi_label else logits.softmax(dim=-1)

    def postprocess(self, outputs: torch.Tensor, items: list[TextItem]) -> list[dict[str, list[dict[str, Any]]]]:
        return top_labels(outputs, self.labels, self.top_k)
