"""The generative handler contract, beside the batch one (``base.Handler``): submit a request, cancel it, and
receive its events.

A generative request does not go through the micro-batcher and the stage threads: the engine batches per decoding
step (continuous batching). The service drives a ``GenerativeHandler`` through a small port whose calls carry
plain data only, so that the engine can run in this process or, later, in a device process fed over a pipe:

1. ``validate(payload)`` in the poll thread (as for every handler): the request body -> a ``Prompt`` (token ids and
   sampling settings), or ``InvalidInput``;
2. ``submit(request_id, prompt)``: start generating (from the poll thread);
3. ``cancel(request_id)``: stop; the request then ends with one ``cancelled`` event (any thread);
4. ``events(timeout_s)``: the events since the last call, in the order they happened, at most ``timeout_s`` of
   waiting for the first; drained by one thread of the service.

Every submitted request ends with exactly one terminal event (``final``, ``error`` or ``cancelled``), after its
``delta`` events. ``submit`` of an id already running is an error of the caller (ids are unique per attempt).

With a device process (``--device-process``), the engine runs there once for every worker: the device process sets
the handler up with role ``device`` and drives it through these same calls, and each worker drives a link to it
(``consumer/accelerator/worker_engine_link.py``) that implements them too. The link adds one terminal event of its own,
``lost``: the device process that held the request died, and the service generates it again under a new attempt.

An engine watches over itself (``health``): one whose loop died, or that makes no progress while it has work, is
replaced in its process; the requests it held end with ``error``, those submitted meanwhile wait for the new one.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from kinference.handlers.base import Handler

EventKind = Literal["delta", "final", "error", "cancelled", "lost"]
TERMINAL: frozenset[str] = frozenset({"final", "error", "cancelled", "lost"})
"""The kinds that end a request's events."""


@dataclass(frozen=True, slots=True)
class Sampling:
    """How to pick the next tokens of one request."""

    max_tokens: int
    """Already capped by the handler (its ``max_new_tokens`` and the context length)."""
    temperature: float = 1.0
    """0 picks the most likely token."""
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    """Generation ends before the first of these strings; the text never contains it."""
    seed: int | None = None


@dataclass(frozen=True, slots=True)
class Prompt:
    """What ``validate`` makes of a request: the prompt's token ids and how to sample."""

    token_ids: tuple[int, ...]
    sampling: Sampling
    stream: bool = False
    """The caller asked for chunks (``"stream": true``); the final reply comes either way."""


@dataclass(frozen=True, slots=True)
class Event:
    """Something that happened to one request."""

    request_id: str
    kind: EventKind
    text: str = ""
    """``delta``: the text since the previous delta; ``final``: the whole text; ``error``: why; ``cancelled``: the
    text so far; ``lost``: nothing (the link's own: the engine that held the request is gone)."""
    completion_tokens: int = 0
    """Tokens generated so far."""
    prompt_tokens: int = 0
    finish_reason: str | None = None
    """``final`` only: ``stop`` (end of sequence or a stop string) or ``length`` (``max_tokens``)."""


@dataclass(frozen=True, slots=True)
class EngineHealth:
    """Whether a generative engine serves: ``/healthz`` names its model while it does not."""

    problem: str | None = None
    """None while it serves; else why not, in words."""
    replacing: bool = False
    """With a problem: True while the engine is being replaced in its process (red until it serves again, and the
    process goes on); False when it cannot be replaced there, and the process must be (exit code 1)."""


SERVING = EngineHealth()


class GenerativePort(Protocol):
    """What the service drives: a ``GenerativeHandler`` in this process, or the link to its engine in the device
    process."""

    def submit(self, request_id: str, prompt: Prompt) -> None: ...

    def cancel(self, request_id: str) -> None: ...

    def events(self, timeout_s: float) -> list[Event]: ...

    @property
    def kv_cache_use(self) -> float | None: ...

    @property
    def health(self) -> EngineHealth: ...


class GenerativeHandler(Handler):
    """Base of handlers that generate. ``setup``, ``validate`` (-> ``Prompt``), ``describe`` and ``close`` are the
    batch contract's hooks; ``submit``, ``cancel`` and ``events`` replace ``preprocess``/``inference``/
    ``postprocess``, which the service never calls on a generative handler."""

    max_sequences: int = 32
    """The most requests the engine generates at once; the service keeps the others waiting (set in ``setup``)."""

    @property
    def generative(self) -> GenerativeHandler:
        return self

    @abstractmethod
    def submit(self, request_id: str, prompt: Prompt) -> None:
        """Start generating for ``prompt``; its events carry ``request_id``."""

    @abstractmethod
    def cancel(self, request_id: str) -> None:
        """Stop generating for ``request_id``; it ends with a ``cancelled`` event (none if it had already ended)."""

    @abstractmethod
    def events(self, timeout_s: float) -> list[Event]:
        """The events since the last call (waiting up to ``timeout_s`` for the first); called by one thread."""

    @property
    def kv_cache_use(self) -> float | None:
        """The fraction of the KV cache in use, for the metrics; None when the engine does not say."""
        return None

    @property
    def health(self) -> EngineHealth:
        """Whether the engine serves (``EngineHealth``); an engine that replaces itself when it fails says so."""
        return SERVING

    def inference(self, inputs: Any) -> Any:
        raise TypeError(f"{type(self).__name__} generates: the service drives it through submit/cancel/events")
