"""Reranking with a cross-encoder: a relevance score for each (query, document) pair, as ``CrossEncoder.rank`` gives.

``--model DIR`` is an ``AutoModelForSequenceClassification`` with one label: a sentence-transformers ``CrossEncoder``
directory, or a plain transformers one. A request is the Cohere/Jina rerank body,
``{"query": "...", "documents": ["...", ...], "top_n": k, "return_documents": false}``; the reply lists the
documents by score, best first, at most ``top_n`` of them:
``{"model": ..., "results": [{"index": i, "relevance_score": s, "document": {"text": ...}}, ...],
"usage": {"total_tokens": n}}`` (``document`` only with ``return_documents``).

The score is the model's logit through the cross-encoder's activation: the one its sentence-transformers files name
(``config_sentence_transformers.json``'s ``activation_fn``, or ``config.json``'s), else the sigmoid that
``CrossEncoder`` applies to a one-label model. Each pair is one row of the batch (handlers/rows.py), tokenised as
one sequence and cut the way ``CrossEncoder`` cuts it: at the model's ``max_length`` (its saved
``max_seq_length``, else the tokenizer's limit capped at the model's positions), the longer of the two texts first.
The model's default prompt, or the request's ``prompt_name`` or ``prompt``, goes before the query, as
``CrossEncoder.rank`` puts it (handlers/rows.py's ``Prompts``). A query far past the limit is cut before it is paired
to what any pair can keep of it (``_usable``), so the poll thread does not tokenise it whole once per document.

Options: ``max_documents`` (default 1000, Cohere's own bound: a request past it is refused, the poll thread tokenises
every pair of a request as it arrives), and those of every text handler (handlers/text.py; ``max_length`` defaults to
the model's as above, ``max_chars`` bounds the query and each document).
"""

from __future__ import annotations

import importlib
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoModelForSequenceClassification

from kinference.errors import HandlerLoadError, InvalidInput
from kinference.handlers.options import positive_int
from kinference.handlers.rows import RowsHandler, Text, read_object
from kinference.handlers.text import TextHandler, encoder

log = logging.getLogger(__name__)

MAX_DOCUMENTS = 1000
"""Cohere's rerank API takes at most 1000 documents a request: the same default bound."""

QUERY_CHARS_PER_TOKEN = 8
"""A query of fewer characters than this many per ``max_length`` token is used whole, without a look at where its
tokens end (English runs at about 4 characters a token)."""

_WHITESPACE = re.compile(r"\s")


@dataclass(frozen=True, slots=True)
class RerankRequest:
    """What a rerank reply needs besides the scores."""

    documents: tuple[str, ...]
    top_n: int
    return_documents: bool


class RerankHandler(RowsHandler):
    name = "rerank"
    model_class = AutoModelForSequenceClassification
    defaults = {**TextHandler.defaults, "max_length": None, "max_documents": MAX_DOCUMENTS}

    def configure(self, options: dict[str, Any]) -> None:
        self.max_documents = positive_int(self.name, "max_documents", options["max_documents"])
        self._whole = encoder(self.tokenizer, self.max_length)
        self._whole.no_truncation()  # a long query's and documents' whole lengths, for where a query can be cut
        architectures = getattr(self.config, "architectures", None) or []
        if any(name.endswith("ForCausalLM") for name in architectures):
            raise HandlerLoadError(f"{self.name}: {architectures[0]} is a causal language model; rerank serves "
                                   "cross-encoders (AutoModelForSequenceClassification), not LLM rerankers yet")
        if self.config.num_labels != 1:
            raise HandlerLoadError(f"{self.name}: the model has {self.config.num_labels} labels; a reranker has one "
                                   "(CrossEncoder.rank takes only those): serve it with --handler text-classification")
        saved = read_object(self.model_dir / "config_sentence_transformers.json")
        self.activation, path = _activation(self.config, saved)
        log.info("%s: scores are the logit through %s (max_length %d)", self.name, path, self.max_length)

    def read(self, payload: Any) -> tuple[Sequence[Text], RerankRequest]:
        if not isinstance(payload, dict):
            raise InvalidInput('expected a JSON object like {"query": "...", "documents": ["...", ...]}')
        query = self._text(payload, "query")
        documents = payload.get("documents")
        if not isinstance(documents, list) or not documents:
            raise InvalidInput('"documents" must be a non-empty array of strings')
        if len(documents) > self.max_documents:
            raise InvalidInput(f'"documents" holds {len(documents)} documents, more than the limit of '
                               f"{self.max_documents} (handler option max_documents)")
        for index, document in enumerate(documents):
            if not isinstance(document, str):
                raise InvalidInput(f'"documents"[{index}] must be a string, got {type(document).__name__}')
            if len(document) > self.max_chars:
                raise InvalidInput(f'"documents"[{index}] has {len(document)} characters, more than the limit of '
                                   f"{self.max_chars} (handler option max_chars)")
        top_n = payload.get("top_n", len(documents))
        if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1:
            raise InvalidInput(f'"top_n" must be an integer >= 1, not {top_n!r}')
        return_documents = payload.get("return_documents", False)
        if not isinstance(return_documents, bool):
            raise InvalidInput(f'"return_documents" must be true or false, not {return_documents!r}')
        request = RerankRequest(tuple(documents), top_n, return_documents)
        query = self._usable(self.prompts.of(payload) + query, documents)
        return [(query, document) for document in documents], request

    def _text(self, payload: dict[str, Any], key: str) -> str:
        if key not in payload:
            raise InvalidInput(f'missing "{key}": expected {{"query": "...", "documents": ["...", ...]}}')
        text = payload[key]
        if not isinstance(text, str) or not text.strip():
            raise InvalidInput(f'"{key}" must be a non-empty string')
        if len(text) > self.max_chars:
            raise InvalidInput(f'"{key}" has {len(text)} characters, more than the limit of {self.max_chars} '
                               "(handler option max_chars)")
        return text

    def _usable(self, query: str, documents: list[str]) -> str:
        """``query`` without the words that change no pair. The query is tokenised again in every pair, so a long one
        would cost the poll thread its length times the documents; cut, each pair tokenises about ``max_length``
        tokens of it, the tokens the pair is priced at.

        What a pair keeps of a query past the limit depends only on whether the query is longer than the document
        (``longest_first`` gives the longer one the odd token), so the cut keeps more tokens than the limit and than
        every document shorter than the whole query, and falls at the first whitespace after them, where the words
        before tokenise as they did. Only with right truncation, the tokenizer's usual side."""
        if len(query) <= QUERY_CHARS_PER_TOKEN * self.max_length or self.tokenizer.truncation_side != "right":
            return query
        tokens = self._whole.encode(query, add_special_tokens=False).offsets
        if len(tokens) <= self.max_length:
            return query
        lengths = [len(encoding) for encoding in self._whole.encode_batch_fast(documents, add_special_tokens=False)]
        keep = max([self.max_length, *(length for length in lengths if length < len(tokens))]) + 1
        space = _WHITESPACE.search(query, tokens[keep - 1][1]) if keep < len(tokens) else None
        return query if space is None else query[: space.start()]

    def reduce(self, output: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        # As CrossEncoder.predict: the logits in float32 (ties broken as it breaks them), the activation, one score.
        scores: torch.Tensor = self.activation(output.logits.float())
        return scores.squeeze(-1)

    def to_host(self, rows: torch.Tensor) -> list[float]:
        scores: list[float] = rows.float().cpu().tolist()
        return scores

    def answer(self, request: RerankRequest, rows: list[float], tokens: int) -> dict[str, Any]:
        # sorted() is stable: equal scores keep the documents' order, as CrossEncoder.rank's sort keeps it.
        ranked = sorted(range(len(rows)), key=rows.__getitem__, reverse=True)[: request.top_n]
        results: list[dict[str, Any]] = [{"index": index, "relevance_score": rows[index]} for index in ranked]
        if request.return_documents:
            for result in results:
                result["document"] = {"text": request.documents[result["index"]]}
        return {"model": self.model_name, "results": results, "usage": {"total_tokens": tokens}}

    def calibration_payloads(self, count: int) -> list[Any]:
        """Queries with four documents each, from the calibration corpus."""
        texts = [payload["text"] for payload in super().calibration_payloads(count * 5)]
        return [{"query": texts[i], "documents": texts[i + 1 : i + 5]} for i in range(0, len(texts), 5)]


def _activation(config: Any, saved: dict[str, Any]) -> tuple[Callable[[torch.Tensor], torch.Tensor], str]:
    """The activation ``CrossEncoder`` applies to the logits, and its dotted path: the one saved (sentence-transformers'
    files first, then ``config.json``'s current and pre-4.0 keys), else a sigmoid. As sentence-transformers does
    without ``trust_remote_code``, only a ``torch.`` class is taken; any other is logged and replaced by the
    sigmoid."""
    in_config = getattr(config, "sentence_transformers", None)
    path = (saved.get("activation_fn")
            or (in_config.get("activation_fn") if isinstance(in_config, dict) else None)
            or getattr(config, "sbert_ce_default_activation_function", None))
    if isinstance(path, str) and path.startswith("torch."):
        module_name, _, class_name = path.rpartition(".")
        try:
            activation = getattr(importlib.import_module(module_name), class_name)()
        except (ImportError, AttributeError, TypeError) as exc:
            raise HandlerLoadError(f"rerank: cannot make the model's activation {path}: {exc}") from exc
        return activation, path
    if path is not None:
        log.warning("rerank: the model's activation %r is not a torch class; a sigmoid instead, as "
                    "sentence-transformers does without trust_remote_code", path)
    return torch.nn.Sigmoid(), "torch.nn.Sigmoid"
