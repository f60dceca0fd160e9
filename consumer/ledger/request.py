"""``Request``, the value that travels through the service: a consumed record and, once known, its outcome.

Every wing hands it on (the path decodes and computes it, delivery answers it, ``ops`` logs and traces it) and every
ledger of this floor accounts for it, so it lives here, below them all. How a Kafka record becomes one is the
path's (``path.request.RequestDecoder``); what its reply and dead-letter records carry is delivery's
(``delivery.answers``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kinference.consumer.types import Headers, ReplyFormat, Route, Trace
from kinference.errors import RequestError


@dataclass(slots=True, eq=False)
class Request:
    """One consumed record and, once known, its outcome. It travels through every stage, on three threads in turn:
    the poll thread (decoder, intake, admission, routing), the stage threads (batcher, stages, or a generative
    model's engine), then the publisher's. A bounded queue hands it from one to the next, so one thread at a time
    writes it.

    Its fields are grouped by who writes them, in the order the request meets them: the record as decoded, then
    what each step adds. Nothing but its owner writes a field. A field that a later step sets is None (or 0)
    until then, and its type says so. ``error`` is the one field several steps write: through ``fail``, which
    keeps the first cause (only the decoder sets it outright: a record it cannot read fails for that reason)."""

    # --- The record, as the decoder (``RequestDecoder.decode``, poll thread) read it: fixed once decoded.
    topic: str
    partition: int
    offset: int
    key: bytes | None
    """None also when the record's key was too large to ride on the answers (``key_omitted``)."""
    value: bytes | None
    headers: Headers
    received: float
    """``time.monotonic()`` when the poll thread got the record: batch delays count from here."""
    correlation_id: str
    reply_topic: str
    timestamp_ms: float | None = None
    """The record's Kafka timestamp (create or log-append time), epoch ms; None if the record has none."""
    key_omitted: int | None = None
    """The size of the record's key when it was larger than ``max_key_bytes``: left out of the answers, which say so."""
    spring_correlation_id: bytes | None = None
    deadline_ms: int | None = None
    reply_partition: int | None = None
    """As the headers ask. Changed later by a generative model's runner, which pins a keyless stream's partition at
    its first chunk (``generations``). Delivery never writes it: a partition the reply topic lacks is the delivery's
    outcome (``answers.ReplyPartitions``), and the reply goes to the default partition."""
    unroutable: bool = False
    """True when the record's headers could not be read at all, so nobody knows where its caller waits for a
    reply: only its dead letter answers it."""
    dead_letter: bool = False
    """True when the record could not be read as a request: it also goes to the dead-letter topic. The stages set
    it too, for a request the handler timed out on, or whose generation failed."""
    model: Route | None = None
    """The model that serves it (``consumer.router``); None without a router (one unnamed model), and for a
    record no model serves (it has an error)."""
    reply_format: ReplyFormat | None = None
    """How the reply value is written when it is not kinference's JSON: an Open Inference Protocol
    ``InferenceResponse`` (``consumer.oip.OipCall``), or a Schema Registry record (``consumer.serdes.SchemaReply``).
    A generative model's engine replaces it for a stream's final answer."""
    payload: Any | None = None
    """The parsed record value (JSON, the raw bytes for ``bytes`` handlers, a ``Record``); None when it could not be
    decoded. Its runner drops it (None again) once done with it (``path.stages``, after postprocess)."""
    held_bytes: int = 0
    """About the memory its value holds, raw and decoded (the decoder's estimate); ``budget.ByteBudget`` charges it
    while in flight, keeping what it charged itself: it never writes the request."""

    # --- Added on the poll thread: by the decoder as it decodes (ledger, trace), then by the runner's admission.
    ledger: Any = field(default=None, repr=False)
    """Where the tracker follows the record: the partition's ``commit.PartitionLedger``, or a share group's
    ``share.ShareRecord``. The intake tracks a fetch's records first and hands each one's ledger to the decoder,
    which sets it as it decodes the record (a record is decoded only once tracked), so Any rather than Optional:
    the delivery modes read it as their own ledger type."""
    trace: Trace | None = None
    """The request's span (``ops.tracing.RequestTrace``), set by the decoder from ``Tracing.received``; None when
    tracing is off."""
    item: Any | None = None
    """What the handler's ``validate`` made of the payload, set by the runner's admission (``path.admission``, in
    its ``put``); ``preprocess`` gets these. None until admitted, and for a request that failed before; dropped with
    ``payload`` by its runner."""
    tokens: int | None = None
    """The handler's ``cost`` of the item (its tokens), set with ``item``; None when the handler does not count
    them."""

    # --- Added by the batcher, when it dispatches the request's batch (a stage thread).
    dispatched: float | None = None
    """``time.monotonic()`` at dispatch; None until dispatched (a generative model's engine sets it when it
    admits the request)."""
    batch_size: int = 0
    """Requests in its batch; 0 until dispatched."""

    # --- Added by the stage that computed it (``stages``, or a generative model's ``generations``).
    reply_value: bytes | None = None
    """The reply's value, written by postprocess; None until then, and for a failed request (``answers`` writes
    its error reply instead)."""
    inference_ms: float = 0.0
    """How long its micro-batch's inference took; 0 until computed."""

    # --- Its outcome: the decoder, the path and the runner, each through ``fail``.
    error: RequestError | None = None
    """The first error (``fail``); None while the request is ok. Delivery never writes it: an answer that fails
    for delivery's own reasons (a missing reply partition, a result too large to publish, unanswerable) is the
    delivery's outcome (``delivery.answers.Delivery.outcome``), which reads this first."""

    @property
    def ok(self) -> bool:
        return self.error is None

    def fail(self, error: RequestError) -> None:
        """Record the first error only: later stages must not overwrite the original cause."""
        if self.error is None:
            self.error = error

    def expired(self, now_epoch_ms: float) -> bool:
        return self.deadline_ms is not None and now_epoch_ms >= self.deadline_ms

    def age_ms(self, now: float, now_epoch_ms: float) -> float:
        """How long the request has waited: since it was written to Kafka when the record has a
        timestamp (so time spent in a paused partition counts), else since the poll thread got it."""
        if self.timestamp_ms is not None:
            return now_epoch_ms - self.timestamp_ms
        return (now - self.received) * 1000
