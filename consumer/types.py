"""The small types every stage shares: a record's headers, a partition's key, and the three things a ``Request``
carries for its answer (its model, how its reply value is written, and its span). Here, not in ``request``, so that
the modules that implement them (``router``, ``oip``, ``serdes``, ``tracing``) and those that read them
(``answers``) need nothing of each other, and ``ledger.request`` nothing above its floor.
"""

from __future__ import annotations

from typing import Any, Protocol

from kinference.protocol import ErrorCode

Headers = list[tuple[str, bytes | None]]
"""A Kafka record's headers, as confluent-kafka hands them over and takes them."""

PartitionKey = tuple[str, int]
"""(topic, partition)."""


class Route(Protocol):
    """The model that serves a request (``router.ModelRoute``), as its answer and its metrics see it."""

    @property
    def name(self) -> str: ...

    @property
    def reply_headers(self) -> tuple[tuple[str, bytes], ...]:
        """The headers naming the model on each of its replies."""


class ReplyFormat(Protocol):
    """A reply value format other than kinference's JSON (``protocol.encode_result``/``encode_error``): an Open
    Inference Protocol ``InferenceResponse`` (``oip.OipCall``), or a Schema Registry record (``serdes.SchemaReply``)."""

    def response(self, result: Any) -> bytes:
        """The reply value of a result; ``RequestError`` when the result cannot be written so."""

    def error(self, code: ErrorCode, message: str) -> bytes:
        """The reply value of a failed request."""

    @property
    def value_headers(self) -> Headers | tuple[()]:
        """Headers the last value written needs beside it (a Schema Registry schema id); mostly none."""


class Trace(Protocol):
    """A request's span (``tracing.RequestTrace``), as its answer sees it."""

    def context_headers(self) -> Headers:
        """The trace context headers that carry the caller's trace on from the request's span."""
