"""OpenAI's wire schemas, as kinference reads and writes them over Kafka: the chat-completions request body (or a
plain ``{"prompt": ...}``), the ``chat.completion`` final reply, the ``chat.completion.chunk`` stream record, and the
embeddings request body. Shared by the generative handler (which reads requests), the service (which writes
replies) and the client (which reads them), so it needs only the standard library.

Everything read here is untrusted: counts and lengths are bounded before anything is built from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kinference.errors import InvalidInput

MAX_MESSAGES = 256
"""The most messages one chat request may carry."""
MAX_STOP = 4
"""OpenAI's own limit on stop sequences."""
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

FINISH_REASONS = ("stop", "length", "deadline", "cancelled")
"""``stop`` (end of sequence or a stop string) and ``length`` (``max_tokens``) are OpenAI's; ``deadline`` (the
request's ``kinference-deadline-ms`` passed mid-way) and ``cancelled`` (a cancel on the control topic) are
kinference's own."""


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """A validated generation request: ``messages`` for the chat template, or a raw ``prompt``."""

    messages: tuple[dict[str, str], ...] | None
    prompt: str | None
    max_tokens: int | None
    """None: the server's cap."""
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    stream: bool = False


def read_chat_request(payload: Any, max_chars: int) -> ChatRequest:
    """A chat-completions body (``messages``...) or ``{"prompt": "..."}``; ``InvalidInput`` naming the field at
    fault. ``max_chars`` bounds the prompt text, all messages together."""
    if not isinstance(payload, dict):
        raise InvalidInput('expected a JSON object: an OpenAI chat-completions body {"messages": [...]} or '
                           '{"prompt": "..."}')
    has_messages, has_prompt = "messages" in payload, "prompt" in payload
    if has_messages == has_prompt:
        raise InvalidInput('expected exactly one of "messages" (a chat-completions body) or "prompt"')
    if payload.get("n", 1) != 1:
        raise InvalidInput('"n" must be 1: one choice per request')
    messages = _messages(payload["messages"], max_chars) if has_messages else None
    prompt = _text(payload["prompt"], "prompt", max_chars) if has_prompt else None
    max_tokens = payload.get("max_completion_tokens", payload.get("max_tokens"))
    return ChatRequest(
        messages=messages,
        prompt=prompt,
        max_tokens=None if max_tokens is None else _int(max_tokens, "max_tokens", 1),
        temperature=_number(payload.get("temperature", 1.0), "temperature", 0.0, 2.0),
        top_p=_number(payload.get("top_p", 1.0), "top_p", 0.0, 1.0, low_open=True),
        stop=_stop(payload.get("stop")),
        seed=None if payload.get("seed") is None else _int(payload["seed"], "seed", -(2**63)),
        stream=_bool(payload.get("stream", False), "stream"),
    )


def _messages(value: Any, max_chars: int) -> tuple[dict[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise InvalidInput('"messages" must be a non-empty array of {"role": ..., "content": ...}')
    if len(value) > MAX_MESSAGES:
        raise InvalidInput(f'"messages" holds {len(value)} messages, more than {MAX_MESSAGES}')
    messages, chars = [], 0
    for index, message in enumerate(value):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise InvalidInput(f'messages[{index}] must be an object with "role" one of {", ".join(sorted(ROLES))}')
        content = _content(message.get("content"), index)
        chars += len(content)
        if chars > max_chars:
            raise InvalidInput(f'"messages" hold more than {max_chars} characters (handler option max_chars)')
        messages.append({"role": message["role"], "content": content})
    return tuple(messages)


def _content(value: Any, index: int) -> str:
    """A message's content: a string, or OpenAI's array of ``{"type": "text", "text": ...}`` parts (joined)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and len(value) <= MAX_MESSAGES and all(
            isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            for part in value):
        return "".join(part["text"] for part in value)
    raise InvalidInput(f'messages[{index}].content must be a string or an array of {{"type": "text", "text": ...}} '
                       "parts (this model reads text only)")


def _text(value: Any, name: str, max_chars: int) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidInput(f'"{name}" must be a non-empty string')
    if len(value) > max_chars:
        raise InvalidInput(f'"{name}" has {len(value)} characters, more than {max_chars} (handler option max_chars)')
    return value


def _int(value: Any, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < 2**63:
        raise InvalidInput(f'"{name}" must be an integer >= {low}, not {value!r}')
    return value


def _number(value: Any, name: str, low: float, high: float, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInput(f'"{name}" must be a number, not {value!r}')
    if not (low < value <= high if low_open else low <= value <= high):
        raise InvalidInput(f'"{name}" must be in {"(" if low_open else "["}{low:g}, {high:g}], not {value!r}')
    return float(value)


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidInput(f'"{name}" must be true or false, not {value!r}')
    return value


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if (not isinstance(stops, list) or len(stops) > MAX_STOP
            or not all(isinstance(stop, str) and 0 < len(stop) <= 256 for stop in stops)):
        raise InvalidInput(f'"stop" must be a string or an array of at most {MAX_STOP} non-empty strings of at '
                           "most 256 characters")
    return tuple(stops)


def completion(ids: tuple[str, str, int], text: str, finish_reason: str, usage: tuple[int, int]) -> dict[str, Any]:
    """The final reply: a ``chat.completion`` object. ``ids``: (completion id, model, created epoch seconds);
    ``usage``: (prompt tokens, completion tokens)."""
    completion_id, model, created = ids
    prompt_tokens, completion_tokens = usage
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


def chunk(ids: tuple[str, str, int], text: str, first: bool) -> dict[str, Any]:
    """A stream record: a ``chat.completion.chunk`` with the text generated since the previous one (the first also
    carries the role, as OpenAI's does)."""
    completion_id, model, created = ids
    delta = {"role": "assistant", "content": text} if first else {"content": text}
    return {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


@dataclass(frozen=True, slots=True)
class EmbeddingsRequest:
    """An OpenAI embeddings body: the texts, in order, and how to encode the vectors (None: the handler's option)."""

    texts: tuple[str, ...]
    encoding_format: str | None


MAX_EMBEDDING_INPUTS = 2048
"""OpenAI's own limit on the inputs of one embeddings request."""


def read_embeddings_request(payload: dict[str, Any]) -> EmbeddingsRequest:
    """``{"input": "text" | ["text", ...], "encoding_format": "float" | "base64"}``; ``InvalidInput`` otherwise.
    (Token-id inputs are not taken: the handler tokenises with its own tokenizer.)"""
    value = payload["input"]
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts or not all(isinstance(text, str) for text in texts):
        raise InvalidInput('"input" must be a string or a non-empty array of strings')
    if len(texts) > MAX_EMBEDDING_INPUTS:
        raise InvalidInput(f'"input" holds {len(texts)} texts, more than {MAX_EMBEDDING_INPUTS}')
    encoding = payload.get("encoding_format")
    if encoding not in (None, "float", "base64"):
        raise InvalidInput(f'"encoding_format" must be "float" or "base64", not {encoding!r}')
    return EmbeddingsRequest(tuple(texts), encoding)
