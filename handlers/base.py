"""The handler contract: the only code a user writes to serve a model with kinference.

A handler module needs nothing from the service: ``from kinference import Handler, HandlerContext,
InvalidInput`` (this module and ``kinference.errors``, which import only the standard library and
``kinference.protocol``). ``--handler package.module:Class`` then serves it.

The service calls:

1. ``validate_many(payloads)`` once per poll of requests as they arrive, in the Kafka poll thread, before
   batching: keep it cheap. By default it calls ``validate(payload)`` for each; a handler can do better for
   many at once (the text handlers tokenise them in one ``encode_batch`` call, in Rust, without the GIL).
   ``validate`` raises ``InvalidInput`` to reject that request alone (it gets a ``bad_request`` reply; the
   rest go on). ``cost(item)`` then tells the batcher how many tokens the item will take.
2. For each micro-batch of validated items (at most ``HandlerContext.max_batch_size``),
   ``preprocess(items)`` in a preprocess thread. By default the items themselves.
3. ``inference(inputs)`` with what ``preprocess`` returned, in an inference thread. Inference threads
   share this one handler instance, so they share one copy of the weights. The one method every handler
   writes.
4. ``postprocess(outputs, items)`` in a postprocess thread: exactly one JSON-serialisable result per
   item, in order. Put an ``InvalidInput`` (or any ``RequestError``) in a slot to fail that item only.
   By default the outputs as a list, one per item.

With a device process (``--device-process``, docs/configuration.md), a handler whose class sets
``device_process = True`` is split across processes: each worker sets it up with ``HandlerContext.role`` ``host``
and calls ``validate_many``, ``preprocess`` and ``postprocess``; the one device process per GPU sets it up with role
``device`` and calls ``warm_up``, ``merge`` and ``inference``, on the preprocessed micro-batches of every worker,
which cross the process boundary in shared memory (tensors and numpy arrays; the rest pickled). Such a handler's
``inference`` returns one row per item (a tensor, an array or a list), so that the rows of a merged batch go back
to the micro-batches they came from.

Before any of this, when the service builds the model, ``batching_defaults(model, options)`` may say how the
model wants to be batched (a TorchServe archive's ``batchSize``...); every batching option the user gives wins.

An exception from ``preprocess``/``inference``/``postprocess`` (any, ``SystemExit`` included; only
``KeyboardInterrupt`` is not contained) fails every request of that micro-batch with ``handler_error``; the
service keeps running.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from kinference.protocol import PayloadFormat

if TYPE_CHECKING:  # a type only: this module imports nothing of the service's at run time
    from kinference.handlers.generative import GenerativeHandler

Role = Literal["process", "host", "device"]
"""Where a handler instance runs: ``process`` does everything (no device process); ``host`` is a worker beside a
device process (validate, preprocess, postprocess: no weights); ``device`` is the device process (the weights,
``warm_up``, ``merge``, ``inference``)."""


@dataclass(frozen=True, slots=True)
class Record:
    """The payload of a ``payload_format = "record"`` handler: the request value with what came beside it."""

    value: bytes
    key: bytes | None
    headers: dict[str, str]
    """The record's headers, values decoded as UTF-8 (undecodable bytes replaced); the last one of a repeated
    name wins."""
    correlation_id: str


@dataclass(frozen=True)
class HandlerContext:
    """What ``setup`` gets: where to run and what to load."""

    device: str
    """A torch device string: ``cpu``, ``cuda`` or ``cuda:N`` (``auto`` was already resolved)."""
    model: Path | None = None
    """The local model directory from ``--model``; ``None`` means the handler's default."""
    options: dict[str, Any] = field(default_factory=dict)
    """Handler-specific settings from ``--handler-options key=value`` / ``handler_options:`` in YAML."""
    max_batch_size: int = 32
    """The most items one ``preprocess``/``inference`` call will get (the service's micro-batch size)."""
    registry: Any = None
    """The service's ``prometheus_client.CollectorRegistry``, for the handler's own metrics (served on /metrics
    with the service's); None outside the service."""
    host_dir: Path | None = None
    """A directory that the worker processes of one host share (``serve --workers N``), for what there is one of per
    host (the ``sim`` handler's device); None in a single process."""
    role: Role = "process"
    """``process``, or the side of a handler split across a worker (``host``) and a device process (``device``)."""
    hang_s: float | None = None
    """How long an engine that has work may make no progress before it is replaced (``--device-hang-s``), for the
    handlers that run one (``generate``); None: never."""


class Handler(ABC):
    """Base class of every handler. Subclasses implement ``inference``; the other hooks have defaults."""

    payload_format: ClassVar[PayloadFormat] = "json"
    """``json``: request values are parsed with orjson; ``bytes``: handed over raw; ``record``: a ``Record``
    (the raw value, the key, the headers)."""

    name: ClassVar[str] = "custom"
    """Shown in logs and the model-info metric."""

    device_process: ClassVar[bool] = False
    """Whether the model can run in a device process apart from the workers: ``preprocess`` returns what can
    cross a process boundary (tensors, arrays, plain data), ``merge`` combines several such inputs, ``inference``
    returns one row per item, and ``setup`` honours ``HandlerContext.role`` (no weights on the ``host`` side)."""

    @property
    def generative(self) -> GenerativeHandler | None:
        """This handler as an engine that generates (``generative.GenerativeHandler``), which the service serves with
        a generative runner instead of the batcher and stages; None (the default): a batch model."""
        return None

    @classmethod
    def batching_defaults(cls, model: Path | None, options: Mapping[str, Any]) -> dict[str, Any]:
        """The batching options (``max_batch_size``, ``micro_batch_size``...) this handler asks for serving
        ``model`` with ``options``, under every one the user sets. Called before ``setup``, on the class."""
        return {}

    def setup(self, context: HandlerContext) -> None:  # noqa: B027 - optional hook
        """Load weights and anything else shared by all threads. Called once before serving."""

    def validate(self, payload: Any) -> Any:
        """Check one request payload and return the item ``preprocess`` gets; raise ``InvalidInput``.

        Called in the Kafka poll thread as each request arrives, so it must be cheap: work done here delays
        every request behind it."""
        return payload

    def validate_many(self, payloads: list[Any]) -> list[Any]:
        """``validate`` for the requests of one poll: one entry per payload, in order, each the item or the
        exception (``InvalidInput``) that rejects that payload alone."""
        items: list[Any] = []
        for payload in payloads:
            try:
                items.append(self.validate(payload))
            except Exception as exc:  # the caller turns it into that request's error reply
                items.append(exc)
        return items

    def cost(self, item: Any) -> int | None:
        """The tokens one validated item will occupy in a batch (after truncation), known before batching.

        The batcher bounds batches by padded tokens (longest x count, config ``max_batch_tokens``) and
        groups waiting requests by it. ``None``: the handler does not count tokens, and batches are bounded
        by request count only."""
        return None

    def preprocess(self, items: list[Any]) -> Any:
        """Turn the validated items of a micro-batch into model inputs (pad, stack, decode); by default the
        items as they are."""
        return items

    @abstractmethod
    def inference(self, inputs: Any) -> Any:
        """Run the model. Called concurrently from every inference thread."""

    def merge(self, inputs: list[Any]) -> Any:
        """Combine the ``preprocess`` results of several micro-batches (of several workers) into one device batch,
        rows in order; only for ``device_process`` handlers, in the device process."""
        raise NotImplementedError(f"{type(self).__name__} sets device_process but does not implement merge")

    def rows(self, inputs: Any) -> int:
        """The batch rows of one ``preprocess`` result: how many outputs ``inference`` returns for it (an item may
        take several rows, as an embeddings request with an ``input`` list does). The device process splits a merged
        batch's outputs by it; only for ``device_process`` handlers."""
        return len(inputs)

    def calibration_payloads(self, count: int) -> list[Any] | None:
        """``count`` request payloads of the traffic the model is expected to serve, for the start-up calibration
        of the device batch size and the worker count (``--workers auto``); None: no calibration."""
        return None

    def postprocess(self, outputs: Any, items: list[Any]) -> list[Any]:
        """Return one result per item, in order; by default the outputs as a list."""
        return list(outputs)

    def warm_up(self) -> None:  # noqa: B027 - optional hook
        """Run a tiny batch so the first request does not pay for lazy initialisation. Called once in each
        inference thread, before serving: torch's thread pools and CUDA streams belong to the thread."""

    def token_counts(self, inputs: Any) -> tuple[int, int] | None:
        """(real, padded) tokens of one ``preprocess`` result, for the padding metrics; None if not text."""
        return None

    def describe(self) -> dict[str, str]:
        """Labels of the model-info metric and the start-up log line."""
        return {"handler": self.name}

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources. Called once after the last batch."""
