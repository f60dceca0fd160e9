"""The service: wires source -> batcher -> stages -> publisher -> commit, and owns their lifecycle.

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

import logging
import math
import threading
import time
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from confluent_kafka import KafkaException

from kinference.consumer.admission import admit
from kinference.consumer.batcher import Batcher
from kinference.consumer.commit import ConsumerCommitter, OffsetTracker
from kinference.consumer.config import ServiceConfig
from kinference.consumer.endpoints import Endpoints
from kinference.consumer.lag import LagMonitor
from kinference.consumer.metrics import Metrics
from kinference.consumer.oip import ServedModel
from kinference.consumer.publisher import Publisher
from kinference.consumer.request import Request, RequestDecoder
from kinference.consumer.source import Committer, Source
from kinference.consumer.stages import Pipeline
from kinference.consumer.transactions import MemberSlot, TransactionalPublisher
from kinference.errors import ConfigError
from kinference.handlers import Handler, HandlerContext, load_handler

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from kinference.consumer.serdes import SchemaRegistryFormat
    from kinference.consumer.tracing import Tracing

log = logging.getLogger(__name__)

_CLOSE_RESERVE_S = 5.0
"""Of the shutdown deadline, the part kept for flushing replies, committing and leaving the group."""
_PAUSE_WAIT_S = 2.0
"""At shutdown, how long to wait for the poll thread to pause (one poll turn, normally)."""


def resolve_device(spec: str) -> str:
    """``auto`` -> ``cuda`` when torch sees a GPU, else ``cpu``; anything else is taken as given."""
    if spec != "auto":
        return spec
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class Service:
    """``with Service(config) as service: service.wait_ready(30)`` runs kinference in this process."""

    def __init__(self, config: ServiceConfig, handler: Handler | None = None,
                 tracer_provider: TracerProvider | None = None) -> None:
        """``tracer_provider``: where spans go with ``tracing`` on, instead of the exporters the OTEL_* environment
        variables name (tests pass one with an in-memory exporter); flushed at stop, never shut down here."""
        self.config = config
        self._tracer_provider = tracer_provider
        self.tracing: Tracing | None = None
        self.handler = handler if handler is not None else load_handler(config.handler)
        self.tracker = OffsetTracker()
        self.metrics = Metrics()
        self.metrics.ready.set_function(lambda: float(all(self.readiness_checks().values())))
        self.metrics.healthy.set_function(lambda: float(self.healthy))
        self.endpoints: Endpoints | None = None
        self._model_ready = False
        self._started = False
        self._stopped = threading.Event()
        self._slot: MemberSlot | None = None
        self.publisher: Publisher | TransactionalPublisher | None = None
        self.batcher: Batcher | None = None
        self.pipeline: Pipeline | None = None
        self.source: Source | None = None
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
        self.tracing = self._open_tracing(config)  # first: a missing package fails before the model loads
        device = resolve_device(config.device)
        if config.torch_threads is not None:
            import torch

            torch.set_num_threads(config.torch_threads)
        self.handler.setup(HandlerContext(device=device, model=_path(config.model),
                                          options=dict(config.handler_options),
                                          max_batch_size=config.micro_batch_size or config.max_batch_size,
                                          registry=self.metrics.registry))
        try:
            self._build(config)
        except KafkaException as exc:
            raise ConfigError(f"the Kafka client configuration was rejected: {exc.args[0].str()}") from exc
        self.pipeline.start()  # type: ignore[union-attr]  # returns once the inference threads warmed up
        self._model_ready = True
        self.metrics.model.info(self.handler.describe())
        log.info("handler ready: %s", self.handler.describe())
        log.info("batching: %s policy, max_batch_size=%d, max_batch_delay_ms=%g, micro_batch_size=%s, parallelism "
                 "%s", config.batch_policy, config.max_batch_size, config.max_batch_delay_ms, config.micro_batch_size,
                 config.parallelism.model_dump())
        self.publisher.start()  # type: ignore[union-attr]
        self.source.start()  # type: ignore[union-attr]
        self.lag.start()  # type: ignore[union-attr]
        self._started = True
        log.info("serving %s -> %s (group %s, %s batching, max batch %d, %s, %s rebalancing)",
                 ",".join(config.request_topics), config.reply_topic, config.group_id, config.batch_policy,
                 config.max_batch_size, config.delivery,
                 "incremental" if config.incremental_rebalancing else "eager")
        return self

    def _build(self, config: ServiceConfig) -> None:
        # Everything in flight fits in the publisher's queue, so the poll thread never waits on it.
        queue_size = config.max_in_flight + config.max_poll_records
        committer: Committer
        if config.delivery == "exactly-once":
            publisher = TransactionalPublisher(
                config.producer_config(),
                self._transactional_id(config),
                config.dead_letter_topic,
                self.tracker,
                group_metadata=lambda: self.source.group_metadata(),  # type: ignore[union-attr]
                queue_size=queue_size,
                metrics=self.metrics,
                commit_interval_s=config.commit_interval_ms / 1000,
                timeout_s=config.transaction_call_timeout_s,
                tracing=self.tracing,
            )
            self.publisher = committer = publisher
        else:
            self.publisher = Publisher(
                config.producer_config(),
                config.dead_letter_topic,
                on_answered=self.tracker.finish,
                queue_size=queue_size,
                metrics=self.metrics,
                delivery_retry_timeout_s=config.delivery_retry_timeout_s,
                stall_timeout_s=config.stall_timeout_s,
                tracing=self.tracing,
            )
            committer = ConsumerCommitter(self.tracker, self.metrics, config.commit_interval_ms / 1000)
        self.batcher = Batcher(config.batch_policy, config.max_batch_size, config.max_batch_delay_ms,
                               reject=self._reply_now, max_batch_tokens=config.max_batch_tokens,
                               max_batch_bytes=config.max_batch_bytes, max_queue_ms=config.max_queue_ms,
                               target_latency_ms=config.target_latency_ms)
        cost = self.batcher.cost
        self.metrics.batch_cost_fixed.set_function(lambda: (cost.fit() or (math.nan, math.nan))[0])
        self.metrics.batch_cost_per_unit.set_function(lambda: (cost.fit() or (math.nan, math.nan))[1])
        self.pipeline = Pipeline(
            self.handler,
            self.batcher.next_batch,
            self.publisher.submit,
            preprocess_threads=config.parallelism.preprocess,
            inference_threads=config.parallelism.inference,
            postprocess_threads=config.parallelism.postprocess,
            max_batch_size=config.max_batch_size,
            micro_batch_size=config.micro_batch_size,
            metrics=self.metrics,
            observe=self.batcher.observe,
            wake=self.batcher.wake,
            tracing=self.tracing,
        )
        decoder = RequestDecoder(config.reply_topic, config.max_request_bytes, self.handler.payload_format,
                                 config.max_header_bytes, config.reply_topic_allowed, self._served_model(config),
                                 self._schemas(config))
        publisher = self.publisher
        self.source = Source(config, decoder, self.tracker, partial(admit, self.handler), self._route,
                             self._reply_now, self.batcher.discard, committer,
                             in_flight=lambda: self.tracker.in_flight + publisher.held, metrics=self.metrics,
                             tracing=self.tracing)
        self.lag = LagMonitor({"bootstrap.servers": config.bootstrap_servers, **config.admin_config()},
                              config.group_id, lambda: self.source.rebalance.partitions,  # type: ignore[union-attr]
                              self.metrics, config.lag_interval_s)

    def _served_model(self, config: ServiceConfig) -> ServedModel | None:
        """What Open Inference Protocol requests name: None when the service takes none."""
        if config.request_format == "kinference" or config.value_format != "json":
            return None
        name = config.model_name or self.handler.describe().get("model") or config.handler
        return ServedModel(name, config.model_version, config.request_format)

    def _schemas(self, config: ServiceConfig) -> SchemaRegistryFormat | None:
        """The Schema Registry format of request and reply values; None for kinference's JSON."""
        if config.value_format == "json":
            return None
        try:
            from kinference.consumer.serdes import SchemaRegistryFormat
        except ImportError as exc:
            raise ConfigError(f"--value-format {config.value_format} needs the Schema Registry client: pip install "
                              f"'kinference[schema-registry]' ({exc})") from exc
        return SchemaRegistryFormat.open(config, self.handler.payload_format)

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
        return self.source is not None and self.source.rebalance.joined.wait(timeout_s)

    def health_checks(self) -> dict[str, bool]:
        """What ``/healthz`` reports: every thread alive and nothing fatal (before start: only that the process
        is)."""
        if not self._started:
            return {"process": True}
        return {
            "source": self.source.alive,  # type: ignore[union-attr]
            "stages": self.pipeline.healthy,  # type: ignore[union-attr]
            "publisher": self.publisher.alive and self.publisher.failure is None,  # type: ignore[union-attr]
        }

    def readiness_checks(self) -> dict[str, bool]:
        """What ``/readyz`` reports. A member in the group with no partitions (more members than partitions) is
        ready: a standby that takes partitions over when another member leaves. A rebalance does not make a
        member unready: it keeps serving the partitions that do not move."""
        source = self.source
        return {
            "model_loaded": self._model_ready,
            "group_joined": source is not None and source.rebalance.joined.is_set(),
            "broker_reachable": source is not None and source.broker_up,
            "healthy": self.healthy,
        }

    @property
    def healthy(self) -> bool:
        return self._started and all(self.health_checks().values())

    def problems(self) -> list[str]:
        """Why the service is not healthy, in words."""
        reasons = [name for name, ok in self.health_checks().items() if not ok]
        if self.source is not None and self.source.fatal is not None:
            reasons.append(f"consumer: {self.source.fatal.str()}")
        if self.publisher is not None and self.publisher.failure is not None:
            reasons.append(f"publisher: {self.publisher.failure}")
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
        source, pipeline, publisher, batcher, lag = self.source, self.pipeline, self.publisher, self.batcher, self.lag
        if source is None or pipeline is None or publisher is None or batcher is None or lag is None:
            return  # unreachable once started; spelled out for the type checker
        source.drain(min(_PAUSE_WAIT_S, grace_s / 10))
        # With the publisher gone, in-flight work can never be answered: waiting for it only delays the restart.
        drain_until = deadline - reserve_s if publisher.alive else time.monotonic()
        if not self.tracker.wait_idle(max(0.0, drain_until - time.monotonic())):
            log.warning("shutdown: %d requests still in flight; they stay uncommitted and are served again after a "
                        "restart", self.tracker.in_flight)
        batcher.close()
        # Idle stages stop within a poll interval; busy ones get what is left of the drain time, and a quarter of
        # the reserve. Then the publisher flushes, and the source commits and leaves the group.
        stages_stopped = pipeline.stop(max(0.0, drain_until - time.monotonic()) + reserve_s / 4)
        publisher.stop(max(0.0, deadline - reserve_s / 2 - time.monotonic()))
        source.close(deadline)
        lag.stop()
        if self.tracing is not None:  # every span that will end has ended: the publisher has stopped
            self.tracing.close(max(0.0, deadline - time.monotonic()))
        if stages_stopped:
            self.handler.close()
        else:
            log.warning("shutdown: a stage thread is still busy (a handler call that does not return); "
                        "handler.close() is skipped")
        if self._slot is not None:
            self._slot.close()
        if self.endpoints is not None:
            self.endpoints.close()
        log.info("stopped")

    def _route(self, request: Request) -> None:
        if request.ok:
            self.batcher.put(request)  # type: ignore[union-attr]
        else:
            self._reply_now(request)

    def _reply_now(self, request: Request) -> None:
        """Requests that will not be computed (bad record, expired deadline) go straight to replies."""
        self.publisher.submit([request])  # type: ignore[union-attr]

    def __enter__(self) -> Service:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def _path(model: Path | None) -> Path | None:
    return Path(model).expanduser() if model is not None else None
