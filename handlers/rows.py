"""Text handlers whose requests take several rows of a batch: a reranker's (query, document) pairs, a list of texts.

Such a request is one item for the batcher, priced by the tokens of all its rows (``cost``: the token budget sees
every pair), and as many rows of the micro-batch as it has texts, beside the rows of the other requests in that
micro-batch: two requests' documents share a forward pass.

``preprocess`` sorts the rows of a micro-batch by length and cuts them into parts of at most ``max_batch_size``
rows, each padded only to its own longest row (and, with shape buckets, to a bucket shape): a request's 5-token and
500-token documents do not pad each other, and a request of a thousand documents never takes a shape larger than the
ones warmed up (and captured as CUDA graphs) for. ``inference`` runs the parts in turn and answers one entry per
request, the results of its rows in its own order: what the device process's contract asks (one row per item), so
the same code serves beside a device process.

A subclass says how a request reads (``read``: its texts or text pairs, and what its answer needs) and how its rows'
results become its answer (``answer``); the tokenising, batching and regrouping are here once.
"""

from __future__ import annotations

import json
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer
from transformers.tokenization_utils_base import VERY_LARGE_INTEGER

from kinference.errors import HandlerLoadError, InvalidInput
from kinference.handlers.base import HandlerContext
from kinference.handlers.text import TextBatch, TextHandler, TextItem, check_model_dir

Text = str | tuple[str, str]
"""One row's input: a text, or a pair of texts tokenised as one sequence (a query and a document)."""


@dataclass(frozen=True, slots=True)
class RowsItem:
    """A validated request: its rows, tokenised, and what its answer needs (the subclass's)."""

    rows: tuple[TextItem, ...]
    request: Any


@dataclass(frozen=True, slots=True)
class RowsBatch:
    """What ``preprocess`` hands to ``inference``: the rows, sorted by length, in padded parts."""

    parts: tuple[TextBatch, ...]
    order: tuple[int, ...]
    """``order[k]``: which row (counted over the items, in item order) the k-th row of the parts is."""
    groups: tuple[int, ...]
    """How many rows each item has, in item order."""


@dataclass(frozen=True, slots=True)
class Prompts:
    """A sentence-transformers model's ``prompts`` and ``default_prompt_name`` (``config_sentence_transformers.json``),
    applied as ``CrossEncoder.rank`` and ``SparseEncoder.encode`` apply them: a request names one (``"prompt_name"``)
    or gives its own (``"prompt"``); else the model's default prompt, if it names one. The prompt goes before the text
    (before a pair's first text, the query), and its tokens count as the text's."""

    prompts: dict[str, str]
    default: str

    @classmethod
    def saved(cls, model_dir: Path) -> Prompts:
        config = read_object(model_dir / "config_sentence_transformers.json")
        saved = config.get("prompts")
        prompts = {name: text for name, text in (saved if isinstance(saved, dict) else {}).items()
                   if isinstance(text, str)}
        default = config.get("default_prompt_name")
        return cls(prompts, prompts.get(default, "") if isinstance(default, str) else "")

    def of(self, payload: dict[str, Any]) -> str:
        """The prompt for ``payload``; ``InvalidInput`` for a prompt it cannot have."""
        name, prompt = payload.get("prompt_name"), payload.get("prompt")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise InvalidInput(f'"prompt" must be a string, not {prompt!r}')
            if name is not None:
                raise InvalidInput('give "prompt" or "prompt_name", not both')
            return prompt
        if name is None:
            return self.default
        if not isinstance(name, str) or name not in self.prompts:
            known = ", ".join(repr(known) for known in self.prompts) or "none"
            raise InvalidInput(f'"prompt_name" {name!r} is not one of the model\'s prompts ({known})')
        return self.prompts[name]


class RowsHandler(TextHandler):
    """Base of the text handlers whose requests take one row per text (or text pair); see the module's docstring."""

    def setup(self, context: HandlerContext) -> None:
        if context.model is None:
            raise HandlerLoadError(f"{self.name} needs --model <local dir>")
        self.model_dir = context.model
        if context.options.get("max_length") is None:
            check_model_dir(self.name, context.model)
            limit = saved_max_length(self.name, context.model)
            context = replace(context, options={**context.options, "max_length": limit})
        self.prompts = Prompts.saved(self.model_dir)
        super().setup(context)
        # The most rows one forward pass takes: the micro-batch size, the largest row bucket.
        self.part_rows = context.max_batch_size

    @abstractmethod
    def read(self, payload: Any) -> tuple[Sequence[Text], Any]:
        """The texts (or pairs) of one request, one row each, and what ``answer`` needs; raise ``InvalidInput``."""

    @abstractmethod
    def answer(self, request: Any, rows: list[Any], tokens: int) -> Any:
        """The reply of one request from its rows' results (``to_host``'s, in the order ``read`` gave the texts) and
        the tokens they took."""

    def validate(self, payload: Any) -> RowsItem:
        (result,) = self.validate_many([payload])
        if isinstance(result, InvalidInput):
            raise result
        return result  # type: ignore[no-any-return]  # validate_many's entries are items or InvalidInput

    def validate_many(self, payloads: list[Any]) -> list[Any]:
        """Every row of every request of a poll in one ``encode_batch_fast`` (see ``TextHandler.validate_many``)."""
        results: list[Any] = []
        texts: list[Text] = []
        spans: list[tuple[int, int, int, Any]] = []
        for payload in payloads:
            try:
                inputs, request = self.read(payload)
            except InvalidInput as exc:
                results.append(exc)
                continue
            spans.append((len(results), len(texts), len(inputs), request))
            results.append(None)
            texts.extend(inputs)
        encodings = self._encoder.encode_batch_fast(texts) if texts else []
        for slot, start, count, request in spans:
            rows = tuple(self._item("", encoding) for encoding in encodings[start : start + count])
            results[slot] = RowsItem(rows, request)
        return results

    def cost(self, item: RowsItem) -> int:  # type: ignore[override]  # a RowsItem, not a TextItem
        return sum(len(row.input_ids) for row in item.rows)

    def sample_rows(self, count: int) -> list[TextItem]:
        items = self.validate_many(self.calibration_payloads(count))
        return [row for item in items if isinstance(item, RowsItem) for row in item.rows][:count]

    def preprocess(self, items: Sequence[RowsItem]) -> RowsBatch:  # type: ignore[override]  # RowsItems
        rows = [row for item in items for row in item.rows]
        order = sorted(range(len(rows)), key=lambda row: len(rows[row].input_ids))
        parts = tuple(
            super(RowsHandler, self).preprocess([rows[row] for row in order[start : start + self.part_rows]])
            for start in range(0, len(rows), self.part_rows)
        )
        return RowsBatch(parts, tuple(order), tuple(len(item.rows) for item in items))

    def merge(self, inputs: list[RowsBatch]) -> RowsBatch:  # type: ignore[override]  # RowsBatches
        """The device process's batch: every worker's parts, each cut to at most ``part_rows`` (the device's largest
        row bucket) and padded to a bucket shape; the rows stay where they were."""
        parts: list[TextBatch] = []
        order: list[int] = []
        groups: list[int] = []
        for batch in inputs:
            parts += [super(RowsHandler, self).merge([piece]) for part in batch.parts
                      for piece in _cut(part, self.part_rows)]
            order += [len(order) + row for row in batch.order]
            groups += batch.groups
        return RowsBatch(tuple(parts), tuple(order), tuple(groups))

    def inference(self, inputs: RowsBatch) -> list[list[Any]]:  # type: ignore[override]  # one list per item
        results = [row for part in inputs.parts for row in self.forward_rows(part)]
        rows: list[Any] = [None] * len(results)
        for position, row in enumerate(inputs.order):
            rows[row] = results[position]
        grouped, start = [], 0
        for count in inputs.groups:
            grouped.append(rows[start : start + count])
            start += count
        return grouped

    def rows(self, inputs: RowsBatch) -> int:  # type: ignore[override]  # a RowsBatch
        """One output per request (``inference`` groups a request's rows), not per row."""
        return len(inputs.groups)

    def token_counts(self, inputs: RowsBatch) -> tuple[int, int]:  # type: ignore[override]  # a RowsBatch
        return (sum(part.real_tokens for part in inputs.parts),
                sum(part.tensors["input_ids"].numel() for part in inputs.parts))

    def postprocess(self, outputs: list[list[Any]], items: list[RowsItem]) -> list[Any]:
        return [self.answer(item.request, rows, self.cost(item)) for rows, item in zip(outputs, items, strict=True)]


def saved_max_length(handler: str, model_dir: Path) -> int:
    """The tokens sentence-transformers' ``Transformer`` module keeps of one input (a pair: both texts together) in
    ``model_dir``: a saved ``model_max_length`` (``sentence_bert_config.json``'s processor or tokenizer arguments, or
    its older ``max_seq_length``) as it is; else the tokenizer's ``model_max_length`` capped at the model's positions.
    ``CrossEncoder`` and ``SparseEncoder`` truncate there, so the handlers do too."""
    saved = read_object(model_dir / "sentence_bert_config.json") if (model_dir / "modules.json").is_file() else {}
    arguments = saved.get("processor_kwargs") or saved.get("tokenizer_args") or {}
    given = arguments.get("model_max_length", saved.get("max_seq_length"))
    if given is not None:
        return int(given)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    positions = getattr(AutoConfig.from_pretrained(model_dir, local_files_only=True), "max_position_embeddings", -1)
    limit = tokenizer.model_max_length if positions in (None, -1) else min(tokenizer.model_max_length, positions)
    if limit >= VERY_LARGE_INTEGER:
        raise HandlerLoadError(f"{handler}: neither the tokenizer nor the model in {model_dir} says how many tokens "
                               "an input may hold: set --handler-options max_length=N")
    return int(limit)


def read_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path`` (a model's settings file); {} where there is none."""
    value = _read_json(path)
    return value if isinstance(value, dict) else {}


def read_array(path: Path) -> list[Any]:
    """The JSON array in ``path`` (``modules.json``); [] where there is none."""
    value = _read_json(path)
    return value if isinstance(value, list) else []


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise HandlerLoadError(f"cannot read {path}: {exc}") from exc


def _cut(batch: TextBatch, most: int) -> list[TextBatch]:
    """``batch`` (collated by a worker: no bucket rows) in row slices of at most ``most`` rows."""
    if batch.real_rows <= most:
        return [batch]
    pieces = []
    for start in range(0, batch.real_rows, most):
        tensors = {name: tensor[start : start + most] for name, tensor in batch.tensors.items()}
        tokens = int(torch.count_nonzero(tensors["attention_mask"]))
        pieces.append(TextBatch(tensors, real_rows=len(tensors["input_ids"]), real_tokens=tokens))
    return pieces
