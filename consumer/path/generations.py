"""A generative model's requests, from admission to their final record: the Kafka side of continuous batching.

A generative request skips the batcher and the stage threads. ``put`` (the poll thread) admits it to the engine,
up to ``max_sequences`` requests at once and ``max_sequences_per_partition`` of one partition (so that one busy
partition cannot take every place); the others wait here in arrival order, and flow control's ``max_in_flight``
pauses the partitions when too many wait. One drain thread then takes the engine's events in batches
(``GenerativeHandler.events``) and, for each request:

- ``delta``: the text is buffered, and sent as a ``chat.completion.chunk`` record at once for the first, then every
  ``stream_every_tokens`` tokens or ``stream_every_ms`` milliseconds (only for ``"stream": true``, and never under
  exactly-once, where only the final is written, inside the transaction);
- ``final``: the request's reply is the ``chat.completion`` (the whole text, ``usage``, ``finish_reason``), handed
  to the publisher as every reply is: its offset is committed only once that record is acknowledged;
- ``error``: the usual error reply and dead letter;
- ``cancelled``: ended by its deadline (``finish_reason`` ``deadline``) or a cancel, with the text so far.

Every record of a request carries its key, its correlation id and the headers ``kinference-event``,
``kinference-sequence`` (0, 1, 2... in one attempt) and ``kinference-attempt`` (new each time the request is
generated), on one partition (``Publisher`` pins a keyless request's partition at its first chunk).

A revoked partition's generations are cancelled and left unanswered: the next owner generates them again, under a
new attempt id. A generation whose engine was lost (``lost``: the device process that ran it died) goes back to
the head of the queue and is generated again here, under a new attempt id, up to ``MAX_ATTEMPTS`` times.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import orjson

from kinference.consumer.config import ServiceConfig
from kinference.consumer.ledger.request import Request
from kinference.consumer.ops.metrics import Metrics
from kinference.consumer.types import Headers, PartitionKey
from kinference.errors import RequestError
from kinference.handlers.generative import Event, GenerativePort, Prompt
from kinference.openai import chunk, completion
from kinference.protocol import ATTEMPT, CORRELATION_ID, EVENT, SEQUENCE, ErrorCode, encode_error

log = logging.getLogger(__name__)

_POLL_S = 0.02
"""The drain thread's wait for events: also how often deadlines and due chunks are looked at."""

MAX_ATTEMPTS = 3
"""Generations of one request whose engine is lost each time: the last such loss fails it with ``handler_error``
(a prompt that kills its device process must not restart it forever; the supervisor gives up after 5 quick deaths
in a row)."""

Answer = Callable[[list[Request]], None]


@dataclass(frozen=True, slots=True)
class StreamChunk:
    """One ``chat.completion.chunk`` record, for the publisher: produced in order with its request's final, never
    tracked for the commit (the final is what answers the request)."""

    request: Request
    value: bytes
    headers: Headers


@dataclass(frozen=True, slots=True)
class GenerationSettings:
    max_sequences: int
    max_sequences_per_partition: int
    stream_every_tokens: int
    stream_every_s: float
    chunks: bool
    """False under exactly-once: only the final record, inside the transaction."""

    @classmethod
    def of(cls, config: ServiceConfig, max_sequences: int) -> GenerationSettings:
        return cls(max_sequences, min(max_sequences, config.max_sequences_per_partition), config.stream_every_tokens,
                   config.stream_every_ms / 1000, config.delivery != "exactly-once")


@dataclass(slots=True, eq=False)
class _Generation:
    """One request while its engine generates it."""

    request: Request
    prompt: Prompt
    attempt: str
    ids: tuple[str, str, int]
    """Completion id, model, created (epoch seconds): the same on each of its records."""
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


class ReplyFormat:
    """The final record's headers (a ``types.ReplyFormat``); its error value is kinference's usual one."""

    def __init__(self, generation: _Generation) -> None:
        self.value_headers: Headers = _stream_headers(generation, "final")

    def response(self, result: Any) -> bytes:
        return orjson.dumps(result)

    def error(self, code: ErrorCode, message: str) -> bytes:
        return encode_error(code, message)


class Generations:
    """The requests of one generative model; ``start``/``stop`` its drain thread."""

    def __init__(self, name: str, handler: GenerativePort, answer: Answer,
                 stream: Callable[[list[StreamChunk]], None], settings: GenerationSettings, metrics: Metrics) -> None:
        self.name = name
        self._handler = handler
        self._answer = answer
        self._stream = stream
        self._settings = settings
        self._metrics = metrics
        self._lock = threading.Lock()
        self._waiting: deque[Request] = deque()
        self._running: dict[str, _Generation] = {}
        self._per_partition: dict[PartitionKey, int] = {}
        self._lost: dict[Request, int] = {}
        """Requests whose engine was lost, and how many times."""
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kinference-generate-{name}", daemon=True)
        self.crashed: str | None = None

    # --- the poll thread

    def put(self, request: Request, *, wake: bool = True) -> None:
        """Queue ``request`` for the engine. ``wake=False`` leaves submitting to the caller's ``wake()``, once for a
        whole poll of prompts (as the batcher's ``put`` does): admission then looks at them all at once."""
        with self._lock:
            self._waiting.append(request)
            if wake:
                self._admit()

    def wake(self) -> None:
        """Requests were put without waking: submit what admission lets in."""
        with self._lock:
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

    def _ids(self) -> tuple[str, str, int]:
        return f"chatcmpl-{uuid.uuid4().hex[:16]}", self.name, int(time.time())

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def in_progress(self) -> int:
        return len(self._running)

    def close(self) -> None:
        """Nothing more is put (the batcher's ``close``): the waiting requests stay, unanswered, for the next owner."""

    def _admit(self) -> None:
        """Submit waiting requests while there is room, the oldest first, each partition within its share."""
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
        return self.crashed is None and self._thread.is_alive()

    @property
    def stuck(self) -> str | None:
        return None if self.crashed is None else f"model {self.name}: the generation drain thread died: {self.crashed}"

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                events = self._handler.events(_POLL_S)
                now = time.monotonic()
                with self._lock:
                    chunks, answered = self._apply(events, now)
                    chunks += self._due(now)
                    self._expire(time.time() * 1000)
                    self._admit()
                if chunks:
                    self._stream(chunks)
                if answered:
                    self._answer(answered)
                self._observe(events)
        except BaseException as exc:  # a drain thread must never die silently: health says so
            self.crashed = repr(exc)
            log.critical("the generation drain thread of model %s died", self.name, exc_info=True)
            raise

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
        value = orjson.dumps(chunk(generation.ids, generation.pending, first=generation.sequence == 0))
        record = StreamChunk(generation.request, value, _stream_headers(generation, "delta"))
        generation.sequence += 1
        generation.pending, generation.pending_tokens, generation.last_sent = "", 0, now
        return [record]

    def _finish(self, generation: _Generation, event: Event) -> Request:
        request = generation.request
        self._lost.pop(request, None)
        if request.reply_format is None:
            request.reply_format = ReplyFormat(generation)
        if event.kind == "error":
            request.fail(RequestError(event.text, ErrorCode.HANDLER_ERROR))
            request.dead_letter = True
            return request
        reason = generation.ending or event.finish_reason or "cancelled"
        text = event.text if event.kind == "final" else generation.text
        body = completion(generation.ids, text, reason, (event.prompt_tokens, event.completion_tokens))
        request.reply_value = orjson.dumps(body)
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


def _stream_headers(generation: _Generation, kind: str) -> Headers:
    """The final record gets its correlation id with the other reply headers (``answers.reply_headers``)."""
    headers: Headers = [(CORRELATION_ID, generation.request.correlation_id.encode())] if kind == "delta" else []
    return [*headers, (EVENT, kind.encode()), (SEQUENCE, str(generation.sequence).encode()),
            (ATTEMPT, generation.attempt.encode())]


def _prompt(request: Request) -> Prompt:
    """The request's prompt: what its handler's ``validate`` made of it. Only admitted requests reach the engine,
    so it is set (``Request.item`` is None before admission)."""
    return cast(Prompt, request.item)
