"""Per-request seeds (OpenAI's ``seed``) for transformers' continuous batching.

The engine samples the next token of every running sequence in one call, ``torch.multinomial`` on the process's
global generator, so a sequence's draws depend on what else runs beside it. It has no per-request generator, but it
has per-request logits processors (``ContinuousBatchingLogitsProcessor``: an argument per logits row, prepared from
each request's own kwargs). ``SeededSampling`` is one, the last of the list: for the row of a request with a seed it
makes the draw itself, from noise that depends only on the seed and the position of the token in the sequence, and
leaves that row with the drawn token alone, which the engine's ``multinomial`` then picks for certain. The draw is
the Gumbel-max trick: ``argmax(logits + G)`` with ``G = -log(-log(U))`` is a sample of ``softmax(logits)``, after the
temperature and top-p of the request (the processors before this one).

So the same prompt with the same seed and sampling settings gives the same text, whatever runs beside it, and again
when its partition moves and another member generates it (a new attempt gets the same text). As for OpenAI's seed
it is best effort: a batch of another shape can round the logits differently in their last bits, which changes a
draw only where two tokens' scores are that close.

Rows of requests without a seed are left as they are (the engine's global generator samples them). A step without a
seeded request costs nothing more; one with some costs a hash over the vocabulary for each row.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessor

NO_SEED = -1
"""A row's argument when its request has no seed."""
_MASK = 0xFFFFFFFF


def row_key(seed: int, position: int) -> int:
    """The noise key of one token of one seeded request: 31 bits from the seed (any int, as OpenAI's) and the token's
    position in the sequence (the prompt's tokens and those generated before it)."""
    key = _mix(_mix(seed & _MASK) ^ (seed >> 32 & _MASK)) ^ _mix(position & _MASK)
    return _mix(key) & 0x7FFFFFFF


def _mix(x: int) -> int:
    """``lowbias32`` (Chris Wellons' integer hash): every input bit moves every output bit."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK
    return x ^ (x >> 16)


def _mix_tensor(x: torch.Tensor) -> torch.Tensor:
    """``_mix`` on int64 tensors of 32-bit values (a product wraps modulo 2^64: its low 32 bits are exact)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK
    return x ^ (x >> 16)


def uniform_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[rows, vocab]`` floats in (0, 1), a function of each row's key and the token id only."""
    ids = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    bits = _mix_tensor(_mix_tensor((keys.to(torch.int64).unsqueeze(-1) * 0x9E3779B1 + ids) & _MASK))
    return ((bits >> 8).to(torch.float32) + 0.5) / float(1 << 24)


class SeededSampling(ContinuousBatchingLogitsProcessor):
    """The draw of seeded requests' rows (see the module); a request passes ``seed=<int>`` to ``add_request``."""

    supported_kwargs: dict[str, type] = {"seed": int}
    ignored_kwargs: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._any = False
        """Whether the batch being prepared has a seeded request; read by ``__call__`` on the same thread."""

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(NO_SEED)

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        # The engine has already moved ``position_offset`` past this step's input: it is the new token's position.
        keys = [NO_SEED if (seed := request.state.logit_processor_kwargs.get("seed")) is None
                else row_key(seed, request.state.position_offset) for request in requests_with_new_token]
        self._any = any(key != NO_SEED for key in keys)
        return torch.tensor(keys, dtype=torch.int32)

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        if not self._any:
            return scores
        keys = tensor_arg[: scores.size(0)]
        gumbel = -torch.log(-torch.log(uniform_noise(keys, scores.size(-1))))
        drawn = torch.argmax(scores + gumbel, dim=-1, keepdim=True)
        only = torch.full_like(scores, float("-inf")).scatter_(-1, drawn, 0.0)
        return torch.where((keys != NO_SEED).unsqueeze(-1), only, scores)


def add_seeded_sampling(manager: Any) -> None:
    """Put ``SeededSampling`` last in a ``ContinuousBatchingManager``'s logits processors. Before ``start()``: the
    engine sizes its per-row argument storage from the list when its thread starts."""
    processors = manager.logit_processor
    processors.logits_processor.append(SeededSampling())
    processors.tensors_required += 1
    processors.supported_keys.update(SeededSampling.supported_kwargs)
    processors.do_processing = True
