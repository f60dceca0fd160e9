"""``Reply``: one reply record as the client hands it to its caller."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from kinference.loadgen.errors import ReplyError
from kinference.protocol import (
    BATCH_SIZE,
    CORRELATION_ID,
    ERROR_CODE,
    INFERENCE_MS,
    QUEUE_MS,
    SERVICE_MS,
    STATUS,
    decode_error,
)


@dataclass(frozen=True, slots=True)
class Reply:
    """A reply record. Error replies are replies too: ``ok`` is False and ``result()`` raises."""

    correlation_id: str
    key: bytes | None
    value: bytes | None
    headers: Mapping[str, bytes]
    """Reply headers by name (the last one wins when a name repeats)."""
    sent_at: float
    """``time.monotonic()`` just before the request was produced."""
    received_at: float
    """``time.monotonic()`` when the reply reader took the reply from the consumer."""

    @classmethod
    def from_record(cls, record: Any, sent_at: float, received_at: float) -> Reply:
        """``record`` is a confluent_kafka.Message (or anything with the same accessors)."""
        headers = {name: raw for name, raw in (record.headers() or []) if raw is not None}
        return cls(
            correlation_id=headers.get(CORRELATION_ID, b"").decode("utf-8", "replace"),
            key=record.key(),
            value=record.value(),
            headers=headers,
            sent_at=sent_at,
            received_at=received_at,
        )

    @property
    def latency_s(self) -> float:
        return self.received_at - self.sent_at

    @property
    def status(self) -> str:
        """``ok`` or ``error`` (kinference-status); a reply without the header counts as ``ok``."""
        return self._text(STATUS) or "ok"

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def error_code(self) -> str | None:
        if self.ok:
            return None
        return self._text(ERROR_CODE) or self._error_body().get("code") or "unknown"

    def json(self) -> Any:
        """The reply value parsed as JSON."""
        return orjson.loads(self.value) if self.value else None

    def result(self) -> Any:
        """The ``result`` of an ok reply; raises ``ReplyError`` for an error reply."""
        if not self.ok:
            raise ReplyError(self.error_code or "unknown", str(self._error_body().get("message", "")), self)
        body = self.json()
        if isinstance(body, dict) and body.get("object") == "chat.completion":
            return body  # a generative model's final is an OpenAI chat.completion itself, with no "result" around it
        return body.get("result") if isinstance(body, dict) else body

    # Server-side figures from the reply headers (None when the service did not send them, e.g. for
    # requests rejected before batching).
    @property
    def queue_ms(self) -> float | None:
        return self._number(QUEUE_MS)

    @property
    def batch_size(self) -> int | None:
        size = self._number(BATCH_SIZE)
        return None if size is None else int(size)

    @property
    def inference_ms(self) -> float | None:
        return self._number(INFERENCE_MS)

    @property
    def service_ms(self) -> float | None:
        return self._number(SERVICE_MS)

    def _text(self, name: str) -> str | None:
        raw = self.headers.get(name)
        return raw.decode("utf-8", "replace") if raw is not None else None

    def _number(self, name: str) -> float | None:
        try:
            return float(self.headers[name])
        except (KeyError, ValueError):
            return None

    def _error_body(self) -> dict[str, Any]:
        return decode_error(self.value)
