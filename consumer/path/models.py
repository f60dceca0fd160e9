"""The served models: the requests of each fetch the intake takes in go to their model's runner
(``runner.Runner``): a batch model's batcher and stage threads (``runner.BatchRunner``), or a generative model's
engine (``generations.GenerativeRunner``), chosen once, here, by the handler (``Handler.generative``) when the model
is built.

Each served model (one by default, several with ``models``) has its own handler (one copy of the weights) and
runner; the source, the publisher, the commit ledger and the device are the process's. The decoder has already named
each record's model (``router``). ``take`` hands each model's requests of a fetch to its runner in one call, whose
admission validates them and refuses, ``overloaded``, those past the model's share of ``max_in_flight``
(``admission.Admission``): the partitions are shared, and pausing them for one slow or stuck model would hold up the
others.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kinference.consumer.accelerator.worker_engine_link import EngineLink
from kinference.consumer.accelerator.worker_link import DeviceInference
from kinference.consumer.config import Batching, ServiceConfig, hang_limit, served_name
from kinference.consumer.ledger.request import Request
from kinference.consumer.ops.metrics import Metrics
from kinference.consumer.path.admission import Admission, Answer
from kinference.consumer.path.batcher import Batcher
from kinference.consumer.path.generations import GenerationSettings, GenerativeRunner
from kinference.consumer.path.router import ModelRoute, Router
from kinference.consumer.path.runner import BatchRunner, Runner
from kinference.consumer.path.stages import Inference, InProcessInference, ModelRun, Pipeline
from kinference.consumer.types import PartitionKey, Route
from kinference.consumer.wire.oip import ServedModel as OipModel
from kinference.errors import ConfigError
from kinference.handlers import Handler, HandlerContext, load_handler
from kinference.handlers.base import Role
from kinference.handlers.generative import GenerativeHandler, GenerativePort

if TYPE_CHECKING:
    from kinference.consumer.accelerator.worker_link import DeviceLink
    from kinference.consumer.delivery.publisher import Publisher
    from kinference.consumer.ops.tracing import Tracing

log = logging.getLogger(__name__)

@dataclass(eq=False)
class LoadedModel:
    """One served model: its settings, its handler, its route and its runner."""

    config: ServiceConfig
    """The service's settings with this model's own in place (``ServiceConfig.for_model``)."""
    batching: Batching
    """How its batches run: its settings', with a device process's inference threads in place."""
    handler: Handler
    route: ModelRoute
    runner: Runner

    @property
    def name(self) -> str:
        return self.route.name


class Models:
    """The process's served models, the default (first) one first. Their handlers are made here and load their
    weights in ``setup``, before Kafka is touched; ``build`` makes each model's runner once there is a publisher to
    answer through."""

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
        """Each model's route and runner (not started), the runner chosen by its handler, once; returns the router
        over their routes. The ``publisher`` takes the requests each model finishes, and those refused at once
        (``submit``), and the chunks of generative models (``stream``)."""
        self._answer = publisher.submit
        # With several models, the most requests each may hold; with one, flow control's pause is the only bound.
        share = max(1, self._config.max_in_flight // len(self.handlers)) if len(self.handlers) > 1 else None
        for settings, handler in self.handlers:
            admission = Admission(served_name(settings, handler), handler, publisher.submit, share)
            generative = handler.generative
            if generative is None:
                model = self._build(settings, admission, publisher.submit, metrics, tracing)
            else:
                model = self._build_generative(settings, generative, admission, publisher, metrics)
            self.loaded.append(model)
            self._by_name[model.name] = model
        return Router([model.route for model in self.loaded], self._config.model_topics())

    def _build(self, settings: ServiceConfig, admission: Admission, answer: Answer, metrics: Metrics,
               tracing: Tracing | None) -> LoadedModel:
        name, handler = admission.name, admission.handler
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
        return LoadedModel(settings, batching, handler, route, BatchRunner(admission, batcher, pipeline))

    def _build_generative(self, settings: ServiceConfig, handler: GenerativeHandler, admission: Admission,
                          publisher: Publisher, metrics: Metrics) -> LoadedModel:
        """A generative model skips the batcher and the stages: its engine batches per decoding step, in this
        process or, with a device process, there (``worker_engine_link``): once for every worker."""
        name = admission.name
        port: GenerativePort = handler
        if self._link is not None and handler.device_process:
            port = EngineLink(self._link.path, name, settings.device_wait_s)
            self._engine_links.append(port)
        runner = GenerativeRunner(admission, port, publisher,
                                  GenerationSettings.of(settings, handler.max_sequences, publisher.streams), metrics)
        route = ModelRoute(name, settings.model_version, handler.payload_format, None)
        return LoadedModel(settings, settings.batching, handler, route, runner)

    def start(self, metrics: Metrics) -> None:
        """Start every model's runner; returns once their inference threads warmed the models up (and the device
        process serves the generative models that run there)."""
        for link in self._engine_links:
            link.connect()
        for model in self.loaded:
            model.runner.start()
            metrics.model.labels(model.name).info(_info_labels(model.handler.describe()))
            batching = model.batching
            log.info("model %s ready: %s; batching: %s policy, max_batch_size=%d, max_batch_delay_ms=%g, "
                     "micro_batch_size=%s, parallelism %s", model.name, model.handler.describe(),
                     batching.batch_policy, batching.max_batch_size, batching.max_batch_delay_ms,
                     batching.micro_batch_size, batching.parallelism.model_dump())

    # --- the intake's side (the poll thread)

    def take(self, requests: list[Request]) -> None:
        """One fetch's decoded requests: those that failed in the decoder straight to their answer, the others to
        their model's runner, one call per model (which admits them)."""
        failed = [request for request in requests if not request.ok]
        if failed:
            self._answered(failed)
        if len(failed) == len(requests):
            return
        if len(self.loaded) == 1:
            self.loaded[0].runner.put([request for request in requests if request.ok] if failed else requests)
            return
        by_model: dict[str, list[Request]] = {}
        for request in requests:
            if request.ok:
                by_model.setdefault(_routed(request).name, []).append(request)
        for name, some in by_model.items():
            self._by_name[name].runner.put(some)

    def _answered(self, requests: list[Request]) -> None:
        """Requests that will not be computed (bad record, expired deadline, refused) go straight to their reply."""
        if self._answer is None:
            raise RuntimeError("a request came before Models.build: nothing to answer it through")
        self._answer(requests)

    def cancel(self, correlation_id: str) -> None:
        """A cancel from the control topic (``control``), to every model: the one holding it stops it."""
        for model in self.loaded:
            model.runner.cancel(correlation_id)

    def discard(self, partitions: list[PartitionKey]) -> list[Request]:
        """The requests of revoked partitions that no model has computed yet, out of every model's runner."""
        return [request for model in self.loaded for request in model.runner.discard(partitions)]

    # --- health and stop

    def health_checks(self) -> dict[str, bool]:
        """One check per model, named after it: an orchestrator's log of the failed probe says which model hung."""
        return {f"model {model.name}": model.runner.healthy for model in self.loaded}

    def problems(self) -> list[str]:
        return list(self.explained().values())

    def explained(self) -> dict[str, str]:
        """Why each failing check of ``health_checks`` fails, by its name (the body of a red ``/healthz``)."""
        return {f"model {model.name}": stuck for model in self.loaded if (stuck := model.runner.stuck) is not None}

    def replacing(self) -> set[str]:
        """The checks of ``health_checks`` that are red while their model replaces its engine by itself: the process
        goes on meanwhile."""
        return {f"model {model.name}" for model in self.loaded if model.runner.replacing}

    def stop(self, stages_by: float) -> None:
        """Close the runners and stop their threads by ``stages_by`` (``time.monotonic()``): idle ones stop within a
        poll interval, busy ones get until then. A model whose threads stopped is closed; one still busy (a handler
        call that does not return) is left running, its ``handler.close`` skipped."""
        for model in self.loaded:
            model.runner.close()
        self._busy = [model for model in self.loaded if not model.runner.stop(max(0.0, stages_by - time.monotonic()))]

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
