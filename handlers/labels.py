"""The ``{"labels": [{"label": ..., "score": ...}]}`` result that the classification handlers share."""

from __future__ import annotations

from typing import Any

import torch


def top_labels(scores: torch.Tensor, labels: list[str], k: int) -> list[dict[str, list[dict[str, Any]]]]:
    """One result per row of ``scores`` (rows x labels): its ``k`` best labels, best first."""
    best, indices = scores.topk(k, dim=1)
    return [
        {"labels": [{"label": labels[i], "score": s} for s, i in zip(row_scores, row_indices, strict=True)]}
        for row_scores, row_indices in zip(best.tolist(), indices.tolist(), strict=True)
    ]
