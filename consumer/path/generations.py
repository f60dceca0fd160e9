"""A generative model's runner (``runner.Runner``): its requests, from admission to their final record, the Kafka
side of continuous batching.

A generative request skips the batcher and the stage threads. ``put`` (the poll thread) takes a fetch's requests
through the model's admission (``admission.Admission``: its handler's ``validate`` makes each one's ``Prompt``), then
admits them to the engine, up to ``max_sequences`` requests at once and ``max_sequences_per_partition`` of one
partition (so that one busy partition cannot take every place); the others wait here in arrival order, and flow
control's ``max_in_flight`` pauses the partitions when too many wait. One drain thread then takes the engine's events
in batches (``GenerativeHandler.events``) and, for each request:

- ``delta``: the text is buffered, and sent as a ``chat.completion.chunk`` record at once for the first, then every
  ``stream_every_tokens`` tokens or ``stream_every_ms`` milliseconds (only for ``"stream": true``, and only where
  the delivery mode produces chunks: ``streams``, not exactly-once's), handed to the publisher (``stream``);
- ``final``: the request's reply is the ``chat.completion`` (the whole text, ``usage``, ``finish_reason``), handed
  to the publisher as every reply is: its offset is committed only once that record is acknowledged;
- ``error``: the usual error reply and dead letter;
- ``cancelled``: ended by its deadline (``finish_reason`` ``deadline``) or a cancel, with the text so far.

Every record of a request carries its key, its correlation id and the headers ``kinference-event``,
``kinference-sequence`` (0, 1, 2... in one attempt) and ``kinference-attempt`` (new each time the request is
generated), written by ``wire.openai``, on one partition (a keyless request's is pinned here at its first chunk).

A request whose ``kinference-deadline-ms`` passes while it waits for a place is answered ``deadline_exceeded`` at
its deadline (within a drain turn), and never reaches the engine; one whose deadline passes while it generates
ends with ``finish_reason`` ``deadline`` and the text so far.

An engine that replaces itself (``GenerativePort.health``: its loop died or hung) makes this model unhealthy until
the new one runs; the requests it held end with ``error``, the others wait. An engine whose ``events`` raises fails
every generation it held (``handler_error``), and the drain goes on.

A revoked partition's generations are cancelled and left unanswered: the next owner generates them again, under a
new attempt id. A generation whose engine was lost (``lost``: the device process that ran it died) goes back to
the head of the queue and is generated again here, under a new attempt id, up to ``MAX_ATTEMPTS`` times.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
import zlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast

from kinference.consumer.config import ServiceConfig
from kinference.consumer.delivery.answers import StreamChunk
from kinference.consumer.ledger.request import Request
from kinference.consumer.ops.metrics import Metrics
from kinference.consumer.path.admission import Admission, let_go
from kinference.consumer.types import PartitionKey
from kinference.consumer.wire.openai import FinalFormat, Ids, chunk_value, completion_value, stream_headers
from kinference.errors import RequestError
from kinference.handlers.generative import Event, GenerativePort, Prompt
from kinference.protocol import ErrorCode

log = logging.getLogger(__name__)

_POLL_S = 0.02
"""The drain thread's wait for events: also how often deadlines and due chunks are looked at."""

MAX_ATTEMPTS = 3
"""Generations of one request whose engine is lost each time: the last such loss fails it with ``handler_error``
(a prompt that kills its device process must not restart it forever; the supervisor gives up after 5 quick deaths
in a row)."""


class Outlet(Protocol):
    """Where a generative model's records go (``delivery.publisher.Publisher``)."""

    def submit(self, requests: list[Request]) -> None:
        """Finished requests, each answered by its final (or its error reply)."""

    def stream(self, chunks: Sequence[StreamChunk]) -> None:
        """Stream chunks, produced before their requests' finals, as the delivery mode says."""

    def reply_partitions(self, topic: str) -> int | None:
        """The reply topic's partition count; None when the broker does not say."""


@dataclass(frozen=True, slots=True)
class GenerationSettings:
    max_sequences: int
    max_sequences_per_partition: int
    stream_every_tokens: int
    stream_every_s: float
    chunks: bool
    """Whether the delivery mode produces stream chunks (``DeliveryMode.streams``; exactly-once's does not): where
    it does not, none is made, and the final is each request's only record (its sequence 0)."""

    @classmethod
    def of(cls, config: ServiceConfig, max_sequences: int, chunks: bool) -> GenerationSettings:
        return cls(max_sequences, min(max_sequences, config.max_sequences_per_partition), config.stream_every_tokens,
                   config.stream_every_ms / 1000, chunks)


@dataclass(slots=True, eq=False)
class _Generation:
    """One request while its engine generates it."""

    request: Request
    prompt: Prompt
    attempt: str
    ids: Ids
    sequence: int = 0
    text: str = ""
    """Every delta's text so far: what a cancelled request's final carries."""
    pending: str = ""
    """Text generated and not sent in a chunk yet."""
    pending_tokens: int = 0
    tokens: int = 0
    """Generated so far."""
    last_sent: float = 0.0
    ending: str | None = None
    """Why it was cancelled (``deadline`` or ``cancelled``), until its engine says it has stopped."""
    started: float = field(default_factory=time.monotonic)


class GenerativeRunner:
    """The runner of one generative model: admission (``put``, the poll thread), its engine (``GenerativePort``, in
    this process or the device process), and the drain thread that turns the engine's events into records
    (``start``/``stop``)."""

    def __init__(self, admission: Admission, handler: GenerativePort, outlet: Outlet, settings: GenerationSettings,
                 metrics: Metrics) -> None:
        """``admission``: the model's, in front of its engine (``handler``: the engine itself, or its link to the
        device process)."""
        self.name = name = admission.name
        self._admission = admission
        self._handler = handler
        self._outlet = outlet
        self._settings = settings
        self._metrics = metrics
        self._lock = threading.Lock()
        self._waiting: deque[Request] = deque()
        self._running: dict[str, _Generation] = {}
        self._per_partition: dict[PartitionKey, int] = {}
        self._lost: dict[Request, int] = {}
        """Requests whose engine was lost, and how many times."""
        self._next_deadline_ms = math.inf
        """The earliest deadline among the waiting requests (or earlier): until then, none of them expires."""
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kinference-generate-{name}", daemon=True)
        self.crashed: str | None = None

    # --- the poll thread

    def put(self, requests: list[Request]) -> None:
        """Admit a fetch's requests (``admission.Admission``), queue them for the engine, and submit what it has room
        for: one lock for all of them."""
        self._admission.put(requests, self.held, self._queue)

    def _queue(self, requests: list[Request]) -> None:
        with self._lock:
            self._waiting.extend(requests)
            for request in requests:
                self._track_deadline(request)
            self._admit()

    def discard(self, partitions: list[PartitionKey]) -> list[Request]:
        """Revoked partitions: their waiting requests, and their generations, cancelled; none is answered here."""
        keys = set(partitions)
        with self._lock:
            dropped = [request for request in self._waiting if (request.topic, request.partition) in keys]
            self._waiting = deque(request for request in self._waiting
                                  if (request.topic, request.partition) not in keys)
            for request_id, generation in list(self._running.items()):
                if (generation.request.topic, generation.request.partition) in keys:
                    self._forget(request_id)
                    self._handler.cancel(request_id)
                    dropped.append(generation.request)
            for request in dropped:
                self._lost.pop(request, None)
            self._admit()
        return dropped

    def cancel(self, correlation_id: str) -> None:
        """A cancel from the control topic: a running generation stops, a waiting request ends at once; each with
        ``finish_reason`` ``cancelled`` and the text it has."""
        with self._lock:
            for request_id, generation in self._running.items():
                if generation.request.correlation_id == correlation_id and generation.ending is None:
                    generation.ending = "cancelled"
                    self._handler.cancel(request_id)
            cancelled = [request for request in self._waiting if request.correlation_id == correlation_id]
            for request in cancelled:
                self._waiting.remove(request)
        for request in cancelled:
            generation = _Generation(request, _prompt(request), uuid.uuid4().hex[:16], self._ids())
            self._answer([self._finish(generation, Event("", "cancelled",
                                                         prompt_tokens=len(generation.prompt.token_ids)))])

    def _ids(self) -> Ids:
        return f"chatcmpl-{uuid.uuid4().hex[:16]}", self.name, int(time.time())

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def in_progress(self) -> int:
        return len(self._running)

    @property
    def held(self) -> int:
        """Waiting for a place, or generating: what counts against the model's share of ``max_in_flight``."""
        return len(self._waiting) + len(self._running)

    def close(self) -> None:
        """Nothing more is put (the batcher's ``close``): the waiting requests stay, unanswered, for the next owner."""

    def _admit(self) -> None:
        """Submit waiting requests while there is room, the oldest first, each partition within its share; those
        past their deadline are answered instead."""
        self._expire_waiting(time.time() * 1000)
        skipped: deque[Request] = deque()
        while self._waiting and len(self._running) < self._settings.max_sequences:
            request = self._waiting.popleft()
            key = (request.topic, request.partition)
            if self._per_partition.get(key, 0) >= self._settings.max_sequences_per_partition:
                skipped.append(request)
                continue
            self._submit(request, key)
        self._waiting.extendleft(reversed(skipped))
        self._metrics.labelled(self._metrics.generation_queued, self.name).set(len(self._waiting))
        self._metrics.labelled(self._metrics.generation_active, self.name).set(len(self._running))

    def _submit(self, request: Request, key: PartitionKey) -> None:
        attempt = uuid.uuid4().hex[:16]
        request_id = f"{request.correlation_id}#{attempt}"
        generation = _Generation(request, _prompt(request), attempt, (f"chatcmpl-{attempt}", self.name,
                                                                      int(time.time())))
        try:
            self._handler.submit(request_id, generation.prompt)
        except Exception as exc:  # an engine that refuses one request fails that request alone
            request.fail(exc if isinstance(exc, RequestError) else
                         RequestError(f"the engine refused the request: {exc!r}", ErrorCode.HANDLER_ERROR))
            self._answer([request])
            return
        request.dispatched = time.monotonic()
        self._running[request_id] = generation
        self._per_partition[key] = self._per_partition.get(key, 0) + 1

    def _track_deadline(self, request: Request) -> None:
        """(Under the lock.) ``request`` waits: its deadline counts for ``_expire_waiting``."""
        if request.deadline_ms is not None:
            self._next_deadline_ms = min(self._next_deadline_ms, request.deadline_ms)

    def _expire_waiting(self, now_epoch_ms: float) -> None:
        """(Under the lock.) Answer the waiting requests whose deadline passed: ``deadline_exceeded``, never
        computed. Looks at the queue only once the earliest deadline in it has come."""
        if now_epoch_ms < self._next_deadline_ms:
            return
        expired = [request for request in self._waiting if request.expired(now_epoch_ms)]
        if expired:
            self._waiting = deque(request for request in self._waiting if not request.expired(now_epoch_ms))
            for request in expired:
                self._lost.pop(request, None)
                request.fail(RequestError("deadline passed before the request was computed",
                                          ErrorCode.DEADLINE_EXCEEDED))
            self._answer(expired)
        self._next_deadline_ms = min((request.deadline_ms for request in self._waiting
                                      if request.deadline_ms is not None), default=math.inf)

    def _forget(self, request_id: str) -> _Generation:
        generation = self._running.pop(request_id)
        key = (generation.request.topic, generation.request.partition)
        self._per_partition[key] -= 1
        return generation

    # --- the drain thread

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float) -> bool:
        """Stop the drain thread; the generations still running are left unanswered (served again after a
        restart). False when the thread did not stop in time."""
        self._stopping.set()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    @property
    def healthy(self) -> bool:
        return self.crashed is None and self._thread.is_alive() and self._handler.health.problem is None

    @property
    def replacing(self) -> bool:
        """Unhealthy only while the engine replaces itself: the process goes on meanwhile."""
        return self.crashed is None and self._thread.is_alive() and self._handler.health.replacing

    @property
    def stuck(self) -> str | None:
        if self.crashed is not None:
            return f"model {self.name}: the generation drain thread died: {self.crashed}"
        return self._handler.health.problem

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                events = self._events()
                now = time.monotonic()
                with self._lock:
                    chunks, answered = self._apply(events, now)
                    chunks += self._due(now)
                    self._expire(time.time() * 1000)
                    self._admit()
                if chunks:
                    self._pin(chunks)
                    self._outlet.stream(chunks)
                if answered:
                    self._answer(answered)
                self._observe(events)
        except BaseException as exc:  # a drain thread must never die silently: health says so
            self.crashed = repr(exc)
            log.critical("the generation drain thread of model %s died", self.name, exc_info=True)
            raise

    def _events(self) -> list[Event]:
        """The engine's events; when it raises, an ``error`` event for each generation it held (their events are
        lost with the call), each cancelled there, and the drain goes on."""
        try:
            return self._handler.events(_POLL_S)
        except Exception as exc:  # the engine's fault fails its requests, not the drain thread
            log.exception("model %s: the engine's events failed; its generations fail with handler_error", self.name)
            with self._lock:
                held = list(self._running)
            for request_id in held:
                self._handler.cancel(request_id)
            time.sleep(_POLL_S)  # an engine that raises at every call must not spin this thread
            return [Event(request_id, "error", f"the engine failed: {exc!r}") for request_id in held]

    def _apply(self, events: list[Event], now: float) -> tuple[list[StreamChunk], list[Request]]:
        chunks, answered, again = [], [], []
        for event in events:
            generation = self._running.get(event.request_id)
            if generation is None:
                continue  # dropped by a revoke: the next owner answers it
            if event.kind == "lost":
                self._forget(event.request_id)
                ended = self._after_loss(generation)
                if ended is None:
                    again.append(generation.request)
                else:
                    answered.append(self._finish(generation, ended))
                continue
            if event.kind == "delta":
                if event.completion_tokens == 1:
                    self._metrics.labelled(self._metrics.time_to_first_token, self.name).observe(
                        now - generation.request.received)
                generation.text += event.text
                generation.pending += event.text
                generation.pending_tokens += 1
                generation.tokens = event.completion_tokens
                if generation.sequence == 0 or self._chunk_due(generation, now):
                    chunks += self._chunk(generation, now)
                continue
            self._forget(event.request_id)
            chunks += self._chunk(generation, now)  # what is buffered goes before the final
            answered.append(self._finish(generation, event))
        self._waiting.extendleft(reversed(again))  # first in line, in their order: ``_admit`` submits them again
        for request in again:
            self._track_deadline(request)
        return chunks, answered

    def _after_loss(self, generation: _Generation) -> Event | None:
        """A generation whose engine was lost: None to generate it again (its buffered text goes with the lost
        attempt); else the event it ends with: a cancel or deadline already asked for, or too many losses."""
        request, prompt_tokens = generation.request, len(generation.prompt.token_ids)
        if generation.ending is not None:
            return Event("", "cancelled", generation.text, generation.tokens, prompt_tokens)
        losses = self._lost[request] = self._lost.get(request, 0) + 1
        if losses < MAX_ATTEMPTS:
            log.info("model %s: request %s generated again: its engine was lost (%d of %d attempts)", self.name,
                     request.correlation_id, losses, MAX_ATTEMPTS)
            return None
        return Event("", "error", f"the engine was lost {losses} times while generating this request",
                     generation.tokens, prompt_tokens)

    def _chunk_due(self, generation: _Generation, now: float) -> bool:
        return (generation.pending_tokens >= self._settings.stream_every_tokens
                or now - generation.last_sent >= self._settings.stream_every_s)

    def _due(self, now: float) -> list[StreamChunk]:
        """Buffered text that has waited ``stream_every_ms``."""
        return [piece for generation in self._running.values()
                if generation.pending and now - generation.last_sent >= self._settings.stream_every_s
                for piece in self._chunk(generation, now)]

    def _chunk(self, generation: _Generation, now: float) -> list[StreamChunk]:
        if not generation.pending or not generation.prompt.stream or not self._settings.chunks:
            return []
        value = chunk_value(generation.ids, generation.pending, first=generation.sequence == 0)
        headers = stream_headers(generation.request.correlation_id, "delta", generation.sequence, generation.attempt)
        record = StreamChunk(generation.request, value, headers)
        generation.sequence += 1
        generation.pending, generation.pending_tokens, generation.last_sent = "", 0, now
        return [record]

    def _pin(self, chunks: list[StreamChunk]) -> None:
        """(The drain thread, outside the lock: it may ask the broker.) A keyless request's records all go to one
        partition, chosen at its first chunk: the producer would spread records without a key over the partitions,
        and a client reads one."""
        for piece in chunks:
            request = piece.request
            if request.key is None and request.reply_partition is None:
                count = self._outlet.reply_partitions(request.reply_topic) or 1
                request.reply_partition = zlib.crc32(request.correlation_id.encode()) % count

    def _answer(self, requests: list[Request]) -> None:
        """Hand finished requests on to be answered (their finals, or error replies), their decoded values let go."""
        let_go(requests)
        self._outlet.submit(requests)

    def _finish(self, generation: _Generation, event: Event) -> Request:
        request = generation.request
        self._lost.pop(request, None)
        if request.reply_format is None:
            request.reply_format = FinalFormat(generation.attempt, generation.sequence)
        if event.kind == "error":
            request.fail(RequestError(event.text, ErrorCode.HANDLER_ERROR))
            request.dead_letter = True
            return request
        reason = generation.ending or event.finish_reason or "cancelled"
        text = event.text if event.kind == "final" else generation.text
        request.reply_value = completion_value(generation.ids, text, reason,
                                               (event.prompt_tokens, event.completion_tokens))
        request.inference_ms = (time.monotonic() - generation.started) * 1000
        return request

    def _expire(self, now_epoch_ms: float) -> None:
        """Cancel the generations whose deadline passed: they end with ``finish_reason`` ``deadline``."""
        for request_id, generation in self._running.items():
            if generation.ending is None and generation.request.expired(now_epoch_ms):
                generation.ending = "deadline"
                self._handler.cancel(request_id)

    def _observe(self, events: list[Event]) -> None:
        tokens = sum(event.kind == "delta" for event in events)
        if tokens:
            self._metrics.labelled(self._metrics.generated_tokens, self.name).inc(tokens)
        use = self._handler.kv_cache_use
        if use is not None:
            self._metrics.labelled(self._metrics.kv_cache_use, self.name).set(use)


def _prompt(request: Request) -> Prompt:
    """The request's prompt: what its handler's ``validate`` made of it. Only admitted requests reach the engine,
    so it is set (``Request.item`` is None before admission)."""
    return cast(Prompt, request.item)
