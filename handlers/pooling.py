"""sentence-transformers' pooling modes on a padded batch: token vectors -> one vector per row.

Each takes the token vectors (rows x tokens x width, float32), the mask of the tokens to pool (the attention mask,
less a prompt the model leaves out) and the attention mask itself, on either padding side: every position is found
from the masks, never assumed (a row's last real token is not at -1 when the row is left-padded, or right-padded to a
shape bucket). The arithmetic is sentence-transformers' ``Pooling._forward_padded`` (6.2), so results agree to
float32 rounding. A row of a shape bucket that is all padding comes out finite (zeros), and is sliced off later.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Pooler = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _cls(tokens: torch.Tensor, mask: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """The first pooled token: ``[CLS]`` where the text starts, or the first token after a prompt left out."""
    return _at(tokens, mask.to(torch.int32).argmax(dim=1))


def _lasttoken(tokens: torch.Tensor, mask: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """The last pooled token (a decoder's, that has seen the whole text); zeros for a row without one."""
    found, from_end = mask.to(torch.int32).flip(1).max(dim=1)
    return _at(tokens, tokens.shape[1] - 1 - from_end) * found.unsqueeze(-1).to(tokens.dtype)


def _max(tokens: torch.Tensor, mask: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    pooled = tokens.masked_fill(mask.unsqueeze(-1) == 0, float("-inf")).max(dim=1).values
    return torch.where(mask.any(dim=1, keepdim=True), pooled, torch.zeros_like(pooled))


def _sum_and_count(tokens: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    weights = mask.unsqueeze(-1).to(tokens.dtype)
    return (tokens * weights).sum(dim=1), weights.sum(dim=1).clamp(min=1e-9)


def _mean(tokens: torch.Tensor, mask: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    total, count = _sum_and_count(tokens, mask)
    return total / count


def _mean_sqrt_len_tokens(tokens: torch.Tensor, mask: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    total, count = _sum_and_count(tokens, mask)
    return total / count.sqrt()


def _weightedmean(tokens: torch.Tensor, mask: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """Each token weighted by its position in the text, 1 for the first real token (a prompt left out keeps its
    positions: the text's first token weighs prompt length + 1)."""
    positions = torch.arange(1, tokens.shape[1] + 1, device=tokens.device, dtype=tokens.dtype).view(1, -1)
    first = attention.to(torch.int32).argmax(dim=1, keepdim=True)
    weights = (mask.to(tokens.dtype) * (positions - first)).unsqueeze(-1)
    return (tokens * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)


def _at(tokens: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return tokens[torch.arange(tokens.shape[0], device=tokens.device), index]


POOLERS: dict[str, Pooler] = {
    "cls": _cls,
    "max": _max,
    "mean": _mean,
    "mean_sqrt_len_tokens": _mean_sqrt_len_tokens,
    "weightedmean": _weightedmean,
    "lasttoken": _lasttoken,
}


def pool(modes: tuple[str, ...], tokens: torch.Tensor, mask: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """Rows x (width x modes): each mode's vector, concatenated in the order of ``modes``."""
    if len(modes) == 1:
        return POOLERS[modes[0]](tokens, mask, attention)
    return torch.cat([POOLERS[mode](tokens, mask, attention) for mode in modes], dim=-1)
