"""The service: wires source -> intake -> models (batcher -> stages) -> publisher -> delivery mode (at-least-once or
exactly-once), in ``Service._build``, and owns their lifecycle. It takes no part in any request's path.

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
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from confluent_kafka import KafkaException

from kinference.consumer.accelerator.worker_link import DeviceLink
from kinference.consumer.config import ServiceConfig
from kinference.consumer.delivery.at_least_once import AtLeastOnce
from kinference.consumer.delivery.exactly_once import ExactlyOnce
from kinference.consumer.delivery.member_slot import MemberSlot
from kinference.consumer.delivery.publisher import DeliveryMode, Publisher, PublishSettings
from kinference.consumer.delivery.topic_metadata import ExistingTopics
from kinference.consumer.ledger.commit import Ledger, OffsetTracker
from kinference.consumer.ledger.commits import Commits, OffsetCommits, TransactionCommits, Transactions
from kinference.consumer.ledger.share import ShareLedger
from kinference.consumer.ops.endpoints import Endpoints, EndpointSettings
from kinference.consumer.ops.lag import LagMonitor
from kinference.consumer.ops.metrics import Metrics
from kinference.consumer.path.control import ControlReader
from kinference.consumer.path.intake import Intake, Tracker
from kinference.consumer.path.models import Models
from kinference.consumer.path.request import RequestDecoder
from kinference.consumer.path.share import ShareSource, set_share_group_start
from kinference.consumer.path.source import MemberSource, Source
from kinference.errors import ConfigError
from kinference.handlers import Handler

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from kinference.consumer.ops.tracing import Tracing
    from kinference.consumer.wire.serdes import SchemaRegistryFormat

log = logging.getLogger(__name__)

_CLOSE_RESERVE_S = 5.0
"""Of the shutdown deadline, the part kept for flushing replies, committing and leaving the group."""
_PAUSE_WAIT_S = 2.0
"""At shutdown, how long to wait for the poll thread to pause (one poll turn, normally)."""
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
                 tracer_provider: TracerProvider | None = None, host_dir: Path | None = None,
                 device_socket: Path | None = None) -> None:
        """``tracer_provider``: where spans go with ``tracing`` on, instead of the exporters the OTEL_* environment
        variables name (tests pass one with an in-memory exporter); flushed at stop, never shut down here.
        ``host_dir``: the directory the workers of one host share (``--workers N``), handed to the handlers.
        ``device_socket``: the device process that runs the models' inference (``device_process``); None: this
        process runs it."""
        self.config = config
        self._host_dir = host_dir
        self._link = None if device_socket is None else DeviceLink(device_socket, config.device_arena_mb << 20,
                                                                    config.device_wait_s)
        self._tracer_provider = tracer_provider
        self.tracing: Tracing | None = None
        self.models = Models(config, handler)
        self.tracker: Ledger | None = None
        """Every consumed record until it is answered: the commit ledger, or a share group's acknowledgements; the
        one ``_build`` chose."""
        self.metrics = Metrics()
        self.metrics.ready.set_function(lambda: float(all(self.readiness_checks().values())))
        self.metrics.healthy.set_function(lambda: float(self.healthy))
        self.endpoints: Endpoints | None = None
        self._model_ready = False
        self._started = False
        self._stopped = threading.Event()
        self._slot: MemberSlot | None = None
        self.publisher: Publisher | None = None
        self.source: MemberSource | None = None
        self.lag: LagMonitor | None = None
        self.control: ControlReader | None = None
        """The control topic's reader (cancels of generations); None without ``control_topic``."""

    def start(self) -> Service:
        config = self.config
        if config.metrics:
            # Up before the model loads, so probes see "alive, not ready" during a slow start.
            self.endpoints = Endpoints(EndpointSettings.of(config), self.metrics.registry, self.health_checks,
                                       self.readiness_checks, self.models.explained).start()
        try:
            return self._start(config)
        except BaseException:
            if self.endpoints is not None:
                self.endpoints.close()
            if self._slot is not None:
                self._slot.close()
            if self.tracing is not None:
                self.tracing.close(_CLOSE_RESERVE_S)
            if self._link is not None:
                self._link.close()
            raise

    def _start(self, config: ServiceConfig) -> Service:
        for warning in config.warnings():
            log.warning("%s", warning)
        self.tracing = self._open_tracing(config)  # first: a missing package fails before the model loads
        device = resolve_device(config.device)
        if config.torch_threads is not None:
            import torch

            torch.set_num_threads(config.torch_threads)
        self.models.setup(device, self.metrics, self._host_dir, self._link)
        try:
            publisher, source = self._build(config)
        except KafkaException as exc:
            raise ConfigError(f"the Kafka client configuration was rejected: {exc.args[0].str()}") from exc
        self.models.start(self.metrics)  # returns once each model's inference threads warmed it up
        self._model_ready = True
        publisher.start()
        source.start()
        if self.lag is not None:
            self.lag.start()
        if config.control_topic is not None:
            self.control = ControlReader(config.consumer_config(), config.control_topic, self.models.cancel)
            self.control.start()
        self._started = True
        log.info("serving %s -> %s (group %s, models %s, %s, %s rebalancing)",
                 ",".join(config.request_topics), config.reply_topic, config.group_id,
                 ", ".join(model.name for model in self.models.loaded), config.delivery,
                 "incremental" if config.incremental_rebalancing else "eager")
        return self

    def _build(self, config: ServiceConfig) -> tuple[Publisher, MemberSource]:
        """The publisher, each model's batcher and stages, and the source with its intake (none started), wired in
        the order a request goes through them; both sides of the delivery mode work on the ledger the intake tracks
        each request in."""
        if config.group_type == "share":
            return self._share_group(config)
        self.tracker = tracker = OffsetTracker()
        producer_config = config.producer_config()
        delivery, commits = self._delivery_mode(config, tracker, producer_config)
        publisher, intake = self._path(config, producer_config, delivery, tracker)
        self.source = source = Source(config, intake, tracker, commits, self.metrics)
        self.lag = LagMonitor({"bootstrap.servers": config.bootstrap_servers, **config.admin_config()},
                              config.group_id, lambda: source.rebalance.partitions, self.metrics,
                              config.lag_interval_s)
        return publisher, source

    def _share_group(self, config: ServiceConfig) -> tuple[Publisher, MemberSource]:
        """``_build`` for a share group: its ledger takes the answered requests too (at-least-once), and its source
        acknowledges each of them."""
        set_share_group_start(config)  # first: a refusal (an ACL) leaves no client behind
        self.tracker = ledger = ShareLedger()
        publisher, intake = self._path(config, config.producer_config(), AtLeastOnce(ledger, config.dead_letter_topic),
                                       ledger)
        self.source = ShareSource(config, intake, ledger, self.metrics)  # no offsets: no lag to measure
        return publisher, self.source

    def _delivery_mode(self, config: ServiceConfig, tracker: OffsetTracker,
                       producer_config: dict[str, str]) -> tuple[DeliveryMode, Commits]:
        """The delivery mode's two sides on the one ledger: the publisher thread's and the poll thread's."""
        interval_s = config.commit_interval_ms / 1000
        if config.delivery == "exactly-once":
            transactions = Transactions()
            producer_config["transactional.id"] = self._transactional_id(config)
            return (ExactlyOnce(tracker, transactions, config.dead_letter_topic, self.metrics, interval_s,
                                config.transaction_call_timeout_s),
                    TransactionCommits(tracker, transactions, config.transaction_call_timeout_s))
        return AtLeastOnce(tracker, config.dead_letter_topic), OffsetCommits(tracker, self.metrics, interval_s)

    def _path(self, config: ServiceConfig, producer_config: dict[str, str], delivery: DeliveryMode,
              tracker: Tracker) -> tuple[Publisher, Intake]:
        """The publisher, answering through ``delivery``; the models, answering through it; and the intake, which
        tracks each record in ``tracker``, decodes it and routes it to its model."""
        self.publisher = publisher = Publisher(producer_config, delivery, PublishSettings.of(config), self.metrics,
                                               tracing=self.tracing)
        router = self.models.build(publisher, self.metrics, self.tracing)
        decoder = RequestDecoder(config.reply_topic, config.max_request_bytes, self.handler.payload_format,
                                 config.max_header_bytes, config.reply_topic_allowed, schemas=self._schemas(config),
                                 router=router, max_key_bytes=config.max_key_bytes,
                                 reply_topic_exists=self._existing_topics(config), tracing=self.tracing)
        return publisher, Intake(decoder, tracker, self.models, publisher.budget)

    @staticmethod
    def _existing_topics(config: ServiceConfig) -> Callable[[str], bool]:
        """Whether a reply topic a request names exists: asked of the cluster only when requests may name one."""
        if not config.reply_topics_allowed:
            return lambda _topic: True  # the default reply topic is the only one: nothing else gets this far
        return ExistingTopics.of({"bootstrap.servers": config.bootstrap_servers, **config.admin_config()})

    @property
    def handler(self) -> Handler:
        """The default model's handler (the only one, unless ``models`` lists several)."""
        return self.models.default_handler

    def _schemas(self, config: ServiceConfig) -> SchemaRegistryFormat | None:
        """The Schema Registry format of request and reply values; None for kinference's JSON."""
        if config.value_format == "json":
            return None
        try:
            from kinference.consumer.wire.serdes import SchemaRegistryFormat
        except ImportError as exc:
            raise ConfigError(f"--value-format {config.value_format} needs the Schema Registry client: pip install "
                              f"'kinference[schema-registry]' ({exc})") from exc
        # The decoded record is every model's payload: a model whose handler takes no JSON fails the start.
        formats = [handler.payload_format for _, handler in self.models.handlers]
        return SchemaRegistryFormat.open(config, next((f for f in formats if f != "json"), "json"))

    def _open_tracing(self, config: ServiceConfig) -> Tracing | None:
        """OpenTelemetry tracing: None when off, so that none of its code runs (nor is imported)."""
        if not config.tracing:
            return None
        try:
            from kinference.consumer.ops.tracing import Tracing
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
        source, publisher = self.source, self.publisher
        if not self._started or source is None or publisher is None:
            return {"process": True}
        return {
            "source": source.alive,
            "publisher": publisher.alive and publisher.failure is None,
            **({} if self.control is None else {"control": self.control.alive}),
            **self.models.health_checks(),
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

    @property
    def failed(self) -> bool:
        """Unhealthy for good: a check is red that nothing in this process repairs (a model replacing its engine is
        red until the new one runs, and the process goes on meanwhile)."""
        replacing = self.models.replacing()
        return self._started and not all(ok or name in replacing for name, ok in self.health_checks().items())

    def problems(self) -> list[str]:
        """Why the service is not healthy, in words."""
        reasons = [name for name, ok in self.health_checks().items() if not ok]
        if self.source is not None and self.source.errors.fatal is not None:
            reasons.append(f"consumer: {self.source.errors.fatal.str()}")
        if self.publisher is not None and self.publisher.failure is not None:
            reasons.append(f"publisher: {self.publisher.failure}")
        return reasons + self.models.problems()

    def stop(self, grace_s: float | None = None) -> None:
        """Stop consuming, drain in-flight work, flush replies, commit and leave the group, all within
        ``grace_s`` (default ``shutdown_grace_s``)."""
        if not self._started or self._stopped.is_set():
            return
        self._stopped.set()
        grace_s = self.config.shutdown_grace_s if grace_s is None else grace_s
        deadline = time.monotonic() + grace_s
        reserve_s = min(_CLOSE_RESERVE_S, grace_s / 3)
        source, publisher, tracker = self.source, self.publisher, self.tracker
        if source is None or publisher is None or tracker is None:
            return  # unreachable once started; spelled out for the type checker
        source.drain(min(_PAUSE_WAIT_S, grace_s / 10))
        if self.control is not None:
            self.control.stop()
        # With the publisher gone, in-flight work can never be answered: waiting for it only delays the restart.
        drain_until = deadline - reserve_s if publisher.alive else time.monotonic()
        if not tracker.wait_idle(max(0.0, drain_until - time.monotonic())):
            log.warning("shutdown: %d requests still in flight; they stay uncommitted and are served again after a "
                        "restart", tracker.in_flight)
        # Idle stages stop within a poll interval; busy ones get what is left of the drain time, and a quarter of
        # the reserve. Then the publisher flushes, and the source commits and leaves the group.
        self.models.stop(max(time.monotonic(), drain_until) + reserve_s / 4)
        publisher.stop(max(0.0, deadline - reserve_s / 2 - time.monotonic()))
        source.close(deadline)
        if self.lag is not None:
            self.lag.stop()
        if self.tracing is not None:  # every span that will end has ended: the publisher has stopped
            self.tracing.close(max(0.0, deadline - time.monotonic()))
        self.models.close()
        if self._link is not None:
            self._link.close()
        if self._slot is not None:
            self._slot.close()
        if self.endpoints is not None:
            self.endpoints.close()
        log.info("stopped")

    def __enter__(self) -> Service:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
