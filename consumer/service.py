"""The service: wires source -> batcher -> stages -> publisher -> commit, and owns their lifecycle.

Each served model (one by default, several with ``models``) has its own handler, batcher and stage threads; the
source, the publisher, the commit ledger and the device are the process's. The source's decoder routes each
record to its model (``consumer/router.py``), and ``_route`` hands it to that model's batcher, unless that model
already holds its share of ``max_in_flight`` (then the request is answered ``overloaded`` at once: the partitions
are shared, and pausing them for one slow or stuck model would hold up the others).

Start order: the stages first (each inference thread warms the model up), then the publisher, the source last,
so that nothing is consumed before the model is ready and there is somewhere to send replies.

Stop (SIGTERM) has one deadline, ``shutdown_grace_s`` from the signal, and follows the data flow: stop taking
records, let in-flight work finish, publish and flush, commit, and leave the group before the deadline so that
the partitions move to other members at once. A handler that never returns does not hold the shutdown: its
requests stay uncommitted (served again after a restart), and ``handler.close`` is skipped since its threads
still run. Keep ``terminationGracePeriodSeconds`` a few seconds above ``shutdown_grace_s`` (deploy/k8s sets
45 for the default 30).
"""

from __future__ import annotations

import gc
import logging
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from confluent_kafka import KafkaException

from kinference.consumer.admission import admit
from kinference.consumer.batcher import Batcher
from kinference.consumer.commit import ConsumerCheckpoint, OffsetTracker
from kinference.consumer.config import ServiceConfig
from kinference.consumer.endpoints import Endpoints
from kinference.consumer.intake import Intake
from kinference.consumer.lag import LagMonitor
from kinference.consumer.metrics import Metrics
from kinference.consumer.oip import ServedModel as OipModel
from kinference.consumer.publisher import Publisher
from kinference.consumer.request import Request, RequestDecoder
from kinference.consumer.router import ModelRoute, Router
from kinference.consumer.share import ShareLedger, ShareSource
from kinference.consumer.source import Source
from kinference.consumer.stages import Pipeline
from kinference.consumer.transactions import MemberSlot, TransactionCheckpoint
from kinference.errors import ConfigError, RequestError
from kinference.handlers import Handler, HandlerContext, load_handler
from kinference.protocol import ErrorCode

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from kinference.consumer.serdes import SchemaRegistryFormat
    from kinference.consumer.tracing import Tracing

log = logging.getLogger(__name__)

_CLOSE_RESERVE_S = 5.0
"""Of the shutdown deadline, the part kept for flushing replies, committing and leaving the group."""
_PAUSE_WAIT_S = 2.0
"""At shutdown, how long to wait for the poll thread to pause (one poll turn, normally)."""


@dataclass(eq=False)
class LoadedModel:
    """One model of the process: its settings, its handler (one copy of the weights) and, once built, its own
    batcher and stage threads. The device, the consumer, the producer and the commit ledger are the process's."""

    config: ServiceConfig
    """The service's settings with this model's own in place (``ServiceConfig.for_model``)."""
    handler: Handler
    route: ModelRoute | None = None
    batcher: Batcher | None = None
    pipeline: Pipeline | None = None
    max_in_flight: int | None = None
    """With several models, the most requests this model may hold (waiting in its batcher or in its stages);
    None with one model, where flow control's pause is the only bound."""

    @property
    def name(self) -> str:
        return self.route.name if self.route is not None else self.config.handler

    def saturation(self) -> RequestError | None:
        """Why a new request for this model is refused at once: it holds its share of ``max_in_flight``. Pausing
        the partitions instead would hold up every other model's requests on them."""
        if self.max_in_flight is None:
            return None
        held = self.batcher.waiting + self.pipeline.in_progress  # type: ignore[union-attr]
        if held < self.max_in_flight:
            return None
        return RequestError(f"model {self.name!r} is saturated: {held} of its requests are in flight, its share of "
                            "max_in_flight (--max-in-flight / number of models)", ErrorCode.OVERLOADED)


_GC_YOUNG_THRESHOLD = 50_000
"""Allocations between young-generation collections (CPython's default: 700)."""


def settle_heap() -> None:
    """Keep the cyclic garbage collector off the per-message path; for a process that serves, once its service has
    started (not in a test process: it is process-wide). Each request allocates a few dozen objects (its record,
    headers, reply, delivery report), none in a reference cycle, so refcounting frees them all and a collection
    finds nothing to free; at CPython's default threshold one ran every few dozen requests, and the older generations
    walked every request in flight and the heap the model's libraries had loaded. So what the start built is frozen
    out of every collection (``gc.freeze``), and collections run every 50,000 allocations: cyclic garbage (an
    exception and its traceback) is still found, a little later."""
    gc.freeze()
    gc.set_threshold(_GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


def resolve_device(spec: str) -> str:
    """``auto`` -> ``cuda`` when torch sees a GPU, else ``cpu``; anything else is taken as given."""
    if spec != "auto":
        return spec
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class Service:
    """``with Service(config) as service: service.wait_ready(30)`` runs kinference in this process."""

    def __init__(self, config: ServiceConfig, handler: Handler | None = None,
                 tracer_provider: TracerProvider | None = None, host_dir: Path | None = None) -> None:
        """``tracer_provider``: where spans go with ``tracing`` on, instead of the exporters the OTEL_* environment
        variables name (tests pass one with an in-memory exporter); flushed at stop, never shut down here.
        ``host_dir``: the directory the workers of one host share (``--workers N``), handed to the handlers."""
        self.config = config
        self._host_dir = host_dir
        self._tracer_provider = tracer_provider
        self.tracing: Tracing | None = None
        if handler is not None and config.models:
            raise ConfigError("a handler object serves one model; with models, each model names its handler")
        self.models = [LoadedModel(settings, handler if handler is not None else load_handler(settings.handler))
                       for settings in config.model_configs()]
        """The served models, the default (first) one first."""
        self._by_name: dict[str, LoadedModel] = {}
        self.tracker: OffsetTracker | ShareLedger = ShareLedger() if config.group_type == "share" else OffsetTracker()
        """Every consumed record until it is answered: the commit ledger, or a share group's acknowledgements."""
        self.metrics = Metrics()
        self.metrics.ready.set_function(lambda: float(all(self.readiness_checks().values())))
        self.metrics.healthy.set_function(lambda: float(self.healthy))
        self.endpoints: Endpoints | None = None
        self._model_ready = False
        self._started = False
        self._stopped = threading.Event()
        self._slot: MemberSlot | None = None
        self.publisher: Publisher | None = None
        self.source: Source | ShareSource | None = None
        self.lag: LagMonitor | None = None

    def start(self) -> Service:
        config = self.config
        if config.metrics:
            # Up before the model loads, so probes see "alive, not ready" during a slow start.
            self.endpoints = Endpoints(config.metrics_host, config.metrics_port, self.metrics.registry,
                                       self.health_checks, self.readiness_checks).start()
        try:
            return self._start(config)
        except BaseException:
            if self.endpoints is not None:
                self.endpoints.close()
            if self._slot is not None:
                self._slot.close()
            if self.tracing is not None:
                self.tracing.close(_CLOSE_RESERVE_S)
            raise

    def _start(self, config: ServiceConfig) -> Service:
        for warning in config.warnings():
            log.warning("%s", warning)
        self.tracing = self._open_tracing(config)  # first: a missing package fails before the model loads
        device = resolve_device(config.device)
        if config.torch_threads is not None:
            import torch

            torch.set_num_threads(config.torch_threads)
        for model in self.models:  # every model on the one device
            settings = model.config
            model.handler.setup(HandlerContext(device=device, model=_path(settings.model),
                                               options=dict(settings.handler_options),
                                               max_batch_size=settings.batching.micro_batch_size
                                               or settings.batching.max_batch_size,
                                               registry=self.metrics.registry, host_dir=self._host_dir))
        try:
            self._build(config)
        except KafkaException as exc:
            raise ConfigError(f"the Kafka client configuration was rejected: {exc.args[0].str()}") from exc
        for model in self.models:
            model.pipeline.start()  # type: ignore[union-attr]  # returns once the inference threads warmed up
            self.metrics.model.labels(model.name).info(_info_labels(model.handler.describe()))
            settings = model.config
            log.info("model %s ready: %s; batching: %s policy, max_batch_size=%d, max_batch_delay_ms=%g, "
                     "micro_batch_size=%s, parallelism %s", model.name, model.handler.describe(),
                     settings.batching.batch_policy, settings.batching.max_batch_size,
                     settings.batching.max_batch_delay_ms, settings.batching.micro_batch_size,
                     settings.batching.parallelism.model_dump())
        self._model_ready = True
        self.publisher.start()  # type: ignore[union-attr]
        self.source.start()  # type: ignore[union-attr]
        if self.lag is not None:
            self.lag.start()
        self._started = True
        log.info("serving %s -> %s (group %s, models %s, %s, %s rebalancing)",
                 ",".join(config.request_topics), config.reply_topic, config.group_id,
                 ", ".join(model.name for model in self.models), config.delivery,
                 "incremental" if config.incremental_rebalancing else "eager")
        return self

    def _build(self, config: ServiceConfig) -> None:
        # Everything in flight fits in the publisher's queue, so the poll thread never waits on it.
        queue_size = config.max_in_flight + config.max_poll_records
        checkpoint: TransactionCheckpoint | ConsumerCheckpoint
        producer_config = config.producer_config()
        if config.delivery == "exactly-once":
            checkpoint = TransactionCheckpoint(
                self.tracker,
                group_metadata=lambda: self.source.group_metadata(),  # type: ignore[union-attr]
                metrics=self.metrics,
                commit_interval_s=config.commit_interval_ms / 1000,
                timeout_s=config.transaction_call_timeout_s,
            )
            producer_config["transactional.id"] = self._transactional_id(config)
        else:
            # A share group's ledger takes the acknowledged requests too; its source acknowledges them itself.
            checkpoint = ConsumerCheckpoint(self.tracker, self.metrics, config.commit_interval_ms / 1000)
        self.publisher = Publisher(
            producer_config,
            config.dead_letter_topic,
            checkpoint,
            queue_size=queue_size,
            metrics=self.metrics,
            delivery_retry_timeout_s=config.delivery_retry_timeout_s,
            stall_timeout_s=config.stall_timeout_s,
            tracing=self.tracing,
        )
        for model in self.models:
            self._build_model(model, self.publisher)
        schemas = self._schemas(config)
        router = Router([model.route for model in self.models], config.model_topics())  # type: ignore[misc]
        decoder = RequestDecoder(config.reply_topic, config.max_request_bytes, self.handler.payload_format,
                                 config.max_header_bytes, config.reply_topic_allowed, schemas=schemas,
                                 router=router)
        intake = Intake(decoder, self.tracker, self._admit, self._route, self._reply_now, self.tracing)
        if isinstance(self.tracker, ShareLedger):  # a share group has no offsets: no lag to measure
            self.source = ShareSource(config, intake, self.tracker, self.metrics)
            return
        publisher, tracker = self.publisher, self.tracker
        self.source = source = Source(config, intake, tracker, self._discard, checkpoint,
                                      in_flight=lambda: tracker.in_flight + publisher.held, metrics=self.metrics)
        self.lag = LagMonitor({"bootstrap.servers": config.bootstrap_servers, **config.admin_config()},
                              config.group_id, lambda: source.rebalance.partitions, self.metrics,
                              config.lag_interval_s)

    def _build_model(self, model: LoadedModel, publisher: Publisher) -> None:
        """The model's route, batcher and stage threads (not started)."""
        settings = model.config
        name = settings.model_name or model.handler.describe().get("model") or settings.handler
        served = (None if settings.request_format == "kinference" or settings.value_format != "json"
                  else OipModel(name, settings.model_version, settings.request_format))
        model.route = ModelRoute(name, settings.model_version, model.handler.payload_format, served)
        self._by_name[name] = model
        model.batcher = batcher = Batcher(settings.batching, self._reply_now, max_queue_ms=settings.max_queue_ms)
        cost = batcher.cost
        self.metrics.batch_cost_fixed.labels(name).set_function(lambda: (cost.fit() or (math.nan, math.nan))[0])
        self.metrics.batch_cost_per_unit.labels(name).set_function(lambda: (cost.fit() or (math.nan, math.nan))[1])
        model.pipeline = Pipeline(
            model.handler,
            batcher.next_batch,
            publisher.submit,
            preprocess_threads=settings.batching.parallelism.preprocess,
            inference_threads=settings.batching.parallelism.inference,
            postprocess_threads=settings.batching.parallelism.postprocess,
            max_batch_size=settings.batching.max_batch_size,
            micro_batch_size=settings.batching.micro_batch_size,
            metrics=self.metrics,
            observe=batcher.observe,
            wake=batcher.wake,
            tracing=self.tracing,
            model=name,
            handler_timeout_s=settings.batching.handler_timeout_s,
        )
        if len(self.models) > 1:
            model.max_in_flight = max(1, self.config.max_in_flight // len(self.models))

    @property
    def handler(self) -> Handler:
        """The default model's handler (the only one, unless ``models`` lists several)."""
        return self.models[0].handler

    @property
    def batcher(self) -> Batcher | None:
        """The default model's batcher."""
        return self.models[0].batcher

    @property
    def pipeline(self) -> Pipeline | None:
        """The default model's stage pipeline."""
        return self.models[0].pipeline

    def _schemas(self, config: ServiceConfig) -> SchemaRegistryFormat | None:
        """The Schema Registry format of request and reply values; None for kinference's JSON."""
        if config.value_format == "json":
            return None
        try:
            from kinference.consumer.serdes import SchemaRegistryFormat
        except ImportError as exc:
            raise ConfigError(f"--value-format {config.value_format} needs the Schema Registry client: pip install "
                              f"'kinference[schema-registry]' ({exc})") from exc
        # The decoded record is every model's payload: a model whose handler takes no JSON fails the start.
        refusing = next((model for model in self.models if model.handler.payload_format != "json"), self.models[0])
        return SchemaRegistryFormat.open(config, refusing.handler.payload_format)

    def _open_tracing(self, config: ServiceConfig) -> Tracing | None:
        """OpenTelemetry tracing: None when off, so that none of its code runs (nor is imported)."""
        if not config.tracing:
            return None
        try:
            from kinference.consumer.tracing import Tracing
        except ImportError as exc:
            raise ConfigError(f"--tracing needs OpenTelemetry: pip install 'kinference[otel]' ({exc})") from exc
        return Tracing.open(config.group_id, self._tracer_provider)

    def _transactional_id(self, config: ServiceConfig) -> str:
        """Stable per member, so that a restarted member fences its own predecessor at once: the configured id,
        else one from the group and the static member id, else from the group, host and a per-host slot."""
        if config.transactional_id is not None:
            return config.transactional_id
        instance = config.consumer_config().get("group.instance.id")
        if instance:
            return f"kinference-{config.group_id}-{instance}"
        self._slot = MemberSlot(config.group_id)
        return self._slot.transactional_id(config.group_id)

    def wait_ready(self, timeout_s: float) -> bool:
        """True once the consumer is in the group (handler loaded, threads running)."""
        return self.source is not None and self.source.joined.wait(timeout_s)

    def health_checks(self) -> dict[str, bool]:
        """What ``/healthz`` reports: every thread alive and nothing fatal (before start: only that the process
        is)."""
        if not self._started:
            return {"process": True}
        return {
            "source": self.source.alive,  # type: ignore[union-attr]
            "publisher": self.publisher.alive and self.publisher.failure is None,  # type: ignore[union-attr]
            # One check per model, named after it: an orchestrator's log of the failed probe says which model hung.
            **{f"model {model.name}": model.pipeline.healthy for model in self.models},  # type: ignore[union-attr]
        }

    def readiness_checks(self) -> dict[str, bool]:
        """What ``/readyz`` reports. A member in the group with no partitions (more members than partitions) is
        ready: a standby that takes partitions over when another member leaves. A rebalance does not make a
        member unready: it keeps serving the partitions that do not move."""
        source = self.source
        return {
            "model_loaded": self._model_ready,
            "group_joined": source is not None and source.joined.is_set(),
            "broker_reachable": source is not None and source.errors.broker_up,
            "healthy": self.healthy,
        }

    @property
    def healthy(self) -> bool:
        return self._started and all(self.health_checks().values())

    def problems(self) -> list[str]:
        """Why the service is not healthy, in words."""
        reasons = [name for name, ok in self.health_checks().items() if not ok]
        if self.source is not None and self.source.errors.fatal is not None:
            reasons.append(f"consumer: {self.source.errors.fatal.str()}")
        if self.publisher is not None and self.publisher.failure is not None:
            reasons.append(f"publisher: {self.publisher.failure}")
        reasons += [model.pipeline.stuck for model in self.models
                    if model.pipeline is not None and model.pipeline.stuck is not None]
        return reasons

    def stop(self, grace_s: float | None = None) -> None:
        """Stop consuming, drain in-flight work, flush replies, commit and leave the group, all within
        ``grace_s`` (default ``shutdown_grace_s``)."""
        if not self._started or self._stopped.is_set():
            return
        self._stopped.set()
        grace_s = self.config.shutdown_grace_s if grace_s is None else grace_s
        deadline = time.monotonic() + grace_s
        reserve_s = min(_CLOSE_RESERVE_S, grace_s / 3)
        source, publisher = self.source, self.publisher
        if source is None or publisher is None:
            return  # unreachable once started; spelled out for the type checker
        source.drain(min(_PAUSE_WAIT_S, grace_s / 10))
        # With the publisher gone, in-flight work can never be answered: waiting for it only delays the restart.
        drain_until = deadline - reserve_s if publisher.alive else time.monotonic()
        if not self.tracker.wait_idle(max(0.0, drain_until - time.monotonic())):
            log.warning("shutdown: %d requests still in flight; they stay uncommitted and are served again after a "
                        "restart", self.tracker.in_flight)
        for model in self.models:
            model.batcher.close()  # type: ignore[union-attr]
        # Idle stages stop within a poll interval; busy ones get what is left of the drain time, and a quarter of
        # the reserve. Then the publisher flushes, and the source commits and leaves the group.
        stages_by = max(time.monotonic(), drain_until) + reserve_s / 4
        stopped = [model.pipeline.stop(max(0.0, stages_by - time.monotonic()))  # type: ignore[union-attr]
                   for model in self.models]
        publisher.stop(max(0.0, deadline - reserve_s / 2 - time.monotonic()))
        source.close(deadline)
        if self.lag is not None:
            self.lag.stop()
        if self.tracing is not None:  # every span that will end has ended: the publisher has stopped
            self.tracing.close(max(0.0, deadline - time.monotonic()))
        for model, stages_stopped in zip(self.models, stopped, strict=True):
            if stages_stopped:
                model.handler.close()
            else:
                log.warning("shutdown: a stage thread of model %s is still busy (a handler call that does not "
                            "return); its handler.close() is skipped", model.name)
        if self._slot is not None:
            self._slot.close()
        if self.endpoints is not None:
            self.endpoints.close()
        log.info("stopped")

    def _admit(self, requests: list[Request]) -> None:
        """Admission of one poll's readable requests, by the handler of each one's model."""
        if len(self.models) == 1:
            admit(self.handler, requests)
            return
        by_model: dict[str, list[Request]] = {}
        for request in requests:
            by_model.setdefault(request.model.name, []).append(request)  # type: ignore[union-attr]
        for name, some in by_model.items():
            admit(self._by_name[name].handler, some)

    def _route(self, request: Request) -> None:
        if request.ok:
            model = self._by_name[request.model.name]  # type: ignore[union-attr]
            refusal = model.saturation()
            if refusal is None:
                model.batcher.put(request)  # type: ignore[union-attr]
                return
            request.fail(refusal)
        self._reply_now(request)

    def _discard(self, partitions: list[tuple[str, int]]) -> list[Request]:
        """The requests of revoked partitions that no model has started on, out of every model's batcher."""
        return [request for model in self.models
                for request in model.batcher.discard(partitions)]  # type: ignore[union-attr]

    def _reply_now(self, request: Request) -> None:
        """Requests that will not be computed (bad record, expired deadline) go straight to replies."""
        self.publisher.submit([request])  # type: ignore[union-attr]

    def __enter__(self) -> Service:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def _info_labels(described: dict[str, str]) -> dict[str, str]:
    """A handler's description as ``kinference_model_info`` labels: its own ``model`` (the weights' name) becomes
    ``weights``, since ``model`` is the served model's name there, as on every other metric."""
    return {("weights" if key == "model" else key): value for key, value in described.items()}


def _path(model: Path | None) -> Path | None:
    return Path(model).expanduser() if model is not None else None
