"""A generative request's records as OpenAI clients read them over Kafka: the ``chat.completion.chunk`` stream
records and the ``chat.completion`` final, their values and their headers. The generative runner
(``path.generations``) decides what to write and when; this module only writes it (the schemas themselves are
``kinference.openai``'s, which the client reads with).

Every record of one generation carries ``kinference-event`` (``delta`` or ``final``), ``kinference-sequence`` (0, 1,
2... in one attempt) and ``kinference-attempt`` (new each time the request is generated); a chunk carries its
correlation id too (the final gets it with the other reply headers, ``answers.reply_headers``).
"""

from __future__ import annotations

from typing import Any

import orjson

from kinference.consumer.types import Headers
from kinference.openai import chunk, completion
from kinference.protocol import ATTEMPT, CORRELATION_ID, EVENT, SEQUENCE, ErrorCode, encode_error

Ids = tuple[str, str, int]
"""Completion id, model, created (epoch seconds): the same on each record of one generation."""


class FinalFormat:
    """The final record's headers (a ``types.ReplyFormat``); its error value is kinference's usual one."""

    def __init__(self, attempt: str, sequence: int) -> None:
        self.value_headers: Headers = stream_headers(None, "final", sequence, attempt)

    def response(self, result: Any) -> bytes:
        return orjson.dumps(result)

    def error(self, code: ErrorCode, message: str) -> bytes:
        return encode_error(code, message)


def chunk_value(ids: Ids, text: str, first: bool) -> bytes:
    """A ``chat.completion.chunk`` with the text generated since the previous one."""
    return orjson.dumps(chunk(ids, text, first=first))


def completion_value(ids: Ids, text: str, finish_reason: str, usage: tuple[int, int]) -> bytes:
    """The final's ``chat.completion``: the whole text, why it ended, ``usage`` (prompt, completion tokens)."""
    return orjson.dumps(completion(ids, text, finish_reason, usage))


def stream_headers(correlation_id: str | None, kind: str, sequence: int, attempt: str) -> Headers:
    """A record's event headers; ``correlation_id`` for a chunk (None for the final: its reply headers carry it)."""
    headers: Headers = [] if correlation_id is None else [(CORRELATION_ID, correlation_id.encode())]
    return [*headers, (EVENT, kind.encode()), (SEQUENCE, str(sequence).encode()), (ATTEMPT, attempt.encode())]
