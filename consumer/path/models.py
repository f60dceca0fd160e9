"""The served models: each request the intake takes in is admitted by its model's handler, then routed to that
model's batcher, from which its stage threads (``stages``) take batches.

Each served model (one by default, several with ``models``) has its own handler (one copy of the weights),
batcher and stage threads; the source, the publisher, the commit ledger and the device are the process's. The
decoder has already named each record's model (``router``). ``route`` hands a request to that model's batcher,
unless that model already holds its share of ``max_in_flight``: then the request is answered ``overloaded`` at
once. The partitions are shared, and pausing them for one slow or stuck model would hold up the others.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kinference.consumer.accelerator.worker_engine_link import EngineLink
from kinference.consumer.accelerator.worker_link import DeviceInference
from kinference.consumer.config import Batching, ServiceConfig, hang_limit, served_name
from kinference.consumer.ledger.request import Request
from kinference.consumer.ops.metrics import Metrics
from kinference.consumer.path.admission import admit
from kinference.consumer.path.batcher import Batcher
from kinference.consumer.path.generations import Generations, GenerationSettings, StreamChunk
from kinference.consumer.path.router import ModelRoute, Router
from kinference.consumer.path.stages import Inference, InProcessInference, ModelRun, Pipeline
from kinference.consumer.types import PartitionKey, Route
from kinference.consumer.wire.oip import ServedModel as OipModel
from kinference.errors import ConfigError, RequestError
from kinference.handlers import Handler, HandlerContext, load_handler
from kinference.handlers.base import Role
from kinference.handlers.generative import GenerativeHandler, GenerativePort
from kinference.protocol import ErrorCode

if TYPE_CHECKING:
    from kinference.consumer.accelerator.worker_link import DeviceLink
    from kinference.consumer.delivery.publisher import Publisher
    from kinference.consumer.ops.tracing import Tracing

log = logging.getLogger(__name__)

Answer = Callable[[list[Request]], None]
"""Hands finished requests on to be answered (``Publisher.submit``)."""
Stream = Callable[[list[StreamChunk]], None]
"""Hands stream chunks of generative requests on to be produced (``Publisher.stream``)."""


@dataclass(eq=False)
class LoadedModel:
    """One served model: its settings, its handler, its route, its batcher and its stage threads."""

    config: ServiceConfig
    """The service's settings with this model's own in place (``ServiceConfig.for_model``)."""
    batching: Batching
    """How its batches run: its settings', with a device process's inference threads in place."""
    handler: Handler
    route: ModelRoute
    batcher: Batcher | Generations
    pipeline: Pipeline | Generations
    """A generative model's ``Generations`` is both: it takes requests one by one and runs its engine's events."""
    max_in_flight: int | None
    """With several models, the most requests this model may hold (waiting in its batcher or in its stages);
    None with one model, where flow control's pause is the only bound."""

    @property
    def name(self) -> str:
        return self.route.name

    def saturation(self) -> RequestError | None:
        """Why a new request for this model is refused at once: it holds its share of ``max_in_flight``."""
        if self.max_in_flight is None:
            return None
        held = self.batcher.waiting + self.pipeline.in_progress
        if held < self.max_in_flight:
            return None
        return RequestError(f"model {self.name!r} is saturated: {held} of its requests are in flight, its share of "
                            "max_in_flight (--max-in-flight / number of models)", ErrorCode.OVERLOADED)


class Models:
    """The process's served models, the default (first) one first. Their handlers are made here and load their
    weights in ``setup``, before Kafka is touched; ``build`` makes each model's batcher and stages once there is a
    publisher to answer through."""

    def __init__(self, config: ServiceConfig, handler: Handler | None = None) -> None:
        """``handler``: a handler object to serve instead of the one ``config.handler`` names (one model only)."""
        if handler is not None and config.models:
            raise ConfigError("a handler object serves one model; with models, each model names its handler")
        self._config = config
        self.handlers = [(settings, handler if handler is not None else load_handler(settings.handler))
                         for settings in config.model_configs()]
        """Each model's settings and handler, before ``build``."""
        self.loaded: list[LoadedModel] = []
        self._by_name: dict[str, LoadedModel] = {}
        self._answer: Answer | None = None
        self._link: DeviceLink | None = None
        self._engine_links: list[EngineLink] = []
        """The generative models whose engine runs in the device process."""
        self._busy: list[LoadedModel] = []
        """Models whose stage threads did not stop (``stop``): their handlers are not closed."""

    @property
    def default_handler(self) -> Handler:
        return self.handlers[0][1]

    def setup(self, device: str, metrics: Metrics, host_dir: Path | None, link: DeviceLink | None) -> None:
        """Load every model's weights, on the one device; with a device process (``link``), only the host side of
        the models that run there (their weights are the device process's)."""
        self._link = link
        for settings, handler in self.handlers:
            batching = settings.batching
            role: Role = "host" if link is not None and handler.device_process else "process"
            handler.setup(HandlerContext(device=device, model=_path(settings.model),
                                         options=dict(settings.handler_options),
                                         max_batch_size=batching.micro_batch_size or batching.max_batch_size,
                                         registry=metrics.registry, host_dir=host_dir, role=role,
                                         hang_s=hang_limit(settings.device_hang_s)))

    def build(self, publisher: Publisher, metrics: Metrics, tracing: Tracing | None) -> Router:
        """Each model's route, batcher and stage threads (not started); returns the router over their routes. The
        ``publisher`` takes the requests each model finishes, and those refused at once (``submit``), and the
        chunks of generative models (``stream``)."""
        answer, stream = publisher.submit, publisher.stream
        self._answer = answer
        share = max(1, self._config.max_in_flight // len(self.handlers)) if len(self.handlers) > 1 else None
        for settings, handler in self.handlers:
            if isinstance(handler, GenerativeHandler):
                model = self._build_generative(settings, handler, answer, stream, metrics)
            else:
                model = self._build(settings, handler, answer, metrics, tracing)
            model.max_in_flight = share
            self.loaded.append(model)
            self._by_name[model.name] = model
        return Router([model.route for model in self.loaded], self._config.model_topics())

    def _build(self, settings: ServiceConfig, handler: Handler, answer: Answer, metrics: Metrics,
               tracing: Tracing | None) -> LoadedModel:
        name = served_name(settings, handler)
        served = (None if settings.request_format == "kinference" or settings.value_format != "json"
                  else OipModel(name, settings.model_version, settings.request_format))
        batcher = Batcher(settings.batching, answer, max_queue_ms=settings.max_queue_ms)
        cost = batcher.cost
        metrics.batch_cost_fixed.labels(name).set_function(lambda: (cost.fit() or (math.nan, math.nan))[0])
        metrics.batch_cost_per_unit.labels(name).set_function(lambda: (cost.fit() or (math.nan, math.nan))[1])
        batching: Batching = settings.batching
        inference: Inference = InProcessInference(handler)
        if self._link is not None and handler.device_process:
            # The inference threads only wait for the device process: one per micro-batch there.
            threads = batching.parallelism.model_copy(update={"inference": settings.device_in_flight})
            batching = batching.model_copy(update={"parallelism": threads})
            inference = DeviceInference(self._link, name)
        pipeline = Pipeline(ModelRun(name, handler, batching, inference), batcher, answer, metrics, tracing)
        route = ModelRoute(name, settings.model_version, handler.payload_format, served)
        return LoadedModel(settings, batching, handler, route, batcher, pipeline, max_in_flight=None)

    def _build_generative(self, settings: ServiceConfig, handler: GenerativeHandler, answer: Answer,
                          stream: Stream, metrics: Metrics) -> LoadedModel:
        """A generative model skips the batcher and the stages: its engine batches per decoding step, in this
        process or, with a device process, there (``worker_engine_link``): once for every worker."""
        name = served_name(settings, handler)
        port: GenerativePort = handler
        if self._link is not None and handler.device_process:
            port = EngineLink(self._link.path, name, settings.device_wait_s)
            self._engine_links.append(port)
        generations = Generations(name, port, answer, stream,
                                  GenerationSettings.of(settings, handler.max_sequences), metrics)
        route = ModelRoute(name, settings.model_version, handler.payload_format, None)
        return LoadedModel(settings, settings.batching, handler, route, generations, generations, max_in_flight=None)

    def start(self, metrics: Metrics) -> None:
        """Start every model's stage threads; returns once their inference threads warmed the models up (and the
        device process serves the generative models that run there)."""
        for link in self._engine_links:
            link.connect()
        for model in self.loaded:
            model.pipeline.start()
            metrics.model.labels(model.name).info(_info_labels(model.handler.describe()))
            batching = model.batching
            log.info("model %s ready: %s; batching: %s policy, max_batch_size=%d, max_batch_delay_ms=%g, "
                     "micro_batch_size=%s, parallelism %s", model.name, model.handler.describe(),
                     batching.batch_policy, batching.max_batch_size, batching.max_batch_delay_ms,
                     batching.micro_batch_size, batching.parallelism.model_dump())

    # --- the intake's side (the poll thread)

    def admit(self, requests: list[Request]) -> None:
        """Admission of one poll's readable requests, by the handler of each one's model."""
        if len(self.loaded) == 1:
            admit(self.loaded[0].handler, requests)
            return
        by_model: dict[str, list[Request]] = {}
        for request in requests:
            by_model.setdefault(_routed(request).name, []).append(request)
        for name, some in by_model.items():
            admit(self._by_name[name].handler, some)

    def route(self, request: Request) -> None:
        """To its model's batcher, without waking its stages (``wake``); or, failed or refused, straight to its
        answer."""
        if request.ok:
            model = self._by_name[_routed(request).name]
            refusal = model.saturation()
            if refusal is None:
                model.batcher.put(request, wake=False)  # ``wake`` after the poll's last request
                return
            request.fail(refusal)
        self.answer_now(request)

    def wake(self) -> None:
        """The poll's requests are all routed: each model's stages look at what waits, once for all of them."""
        for model in self.loaded:
            model.batcher.wake()

    def answer_now(self, request: Request) -> None:
        """A request that will not be computed (bad record, expired deadline, refused) goes straight to its reply."""
        if self._answer is None:
            raise RuntimeError("a request came before Models.build: nothing to answer it through")
        self._answer([request])

    def cancel(self, correlation_id: str) -> None:
        """A cancel from the control topic (``control``), to every generative model: the one holding it stops it."""
        for model in self.loaded:
            if isinstance(model.batcher, Generations):
                model.batcher.cancel(correlation_id)

    def discard(self, partitions: list[PartitionKey]) -> list[Request]:
        """The requests of revoked partitions that no model has started on, out of every model's batcher."""
        return [request for model in self.loaded for request in model.batcher.discard(partitions)]

    # --- health and stop

    def health_checks(self) -> dict[str, bool]:
        """One check per model, named after it: an orchestrator's log of the failed probe says which model hung."""
        return {f"model {model.name}": model.pipeline.healthy for model in self.loaded}

    def problems(self) -> list[str]:
        return list(self.explained().values())

    def explained(self) -> dict[str, str]:
        """Why each failing check of ``health_checks`` fails, by its name (the body of a red ``/healthz``)."""
        return {f"model {model.name}": stuck for model in self.loaded if (stuck := model.pipeline.stuck) is not None}

    def replacing(self) -> set[str]:
        """The checks of ``health_checks`` that are red while their model replaces its engine by itself: the process
        goes on meanwhile."""
        return {f"model {model.name}" for model in self.loaded
                if isinstance(model.pipeline, Generations) and model.pipeline.replacing}

    def stop(self, stages_by: float) -> None:
        """Close the batchers and stop the stages by ``stages_by`` (``time.monotonic()``): idle stages stop within
        a poll interval, busy ones get until then. A model whose stage threads stopped is closed; one still busy
        (a handler call that does not return) is left running, its ``handler.close`` skipped."""
        for model in self.loaded:
            model.batcher.close()
        self._busy = [model for model in self.loaded if not model.pipeline.stop(max(0.0, stages_by - time.monotonic()))]

    def close(self) -> None:
        """Close the handlers whose stages stopped (after ``stop``, once nothing more is published)."""
        for model in self.loaded:
            if model in self._busy:
                log.warning("shutdown: a stage thread of model %s is still busy (a handler call that does not "
                            "return); its handler.close() is skipped", model.name)
            else:
                model.handler.close()
        for link in self._engine_links:
            link.close()


def _routed(request: Request) -> Route:
    """An ok request's model: the decoder's router picked it (a record that no model serves has an error)."""
    route = request.model
    if route is None:
        raise RuntimeError(f"request {request.correlation_id} is ok but no model was picked for it")
    return route


def _info_labels(described: dict[str, str]) -> dict[str, str]:
    """A handler's description as ``kinference_model_info`` labels: its own ``model`` (the weights' name) becomes
    ``weights``, since ``model`` is the served model's name there, as on every other metric."""
    return {("weights" if key == "model" else key): value for key, value in described.items()}


def _path(model: Path | None) -> Path | None:
    return Path(model).expanduser() if model is not None else None
