"""The service: wires source -> batcher -> stages -> publisher -> commit, and owns their lifecycle.

Start order: the stages first (each inference thread warms the model up), then the publisher, the
source last, so that nothing is consumed before the model is ready and there is somewhere to send
replies; stop order follows the data flow: stop consuming, drain in-flight work within the grace
period, publish and flush, commit, close.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from pathlib import Path
from types import TracebackType

from confluent_kafka import KafkaException

from kinference.consumer.admission import admit
from kinference.consumer.batcher import Batcher
from kinference.consumer.commit import OffsetTracker
from kinference.consumer.config import ServiceConfig
from kinference.consumer.endpoints import Endpoints
from kinference.consumer.metrics import Metrics
from kinference.consumer.publisher import Publisher
from kinference.consumer.request import Request, RequestDecoder
from kinference.consumer.source import Source
from kinference.consumer.stages import Pipeline
from kinference.consumer.transactions import TransactionalPublisher
from kinference.errors import ConfigError
from kinference.handlers import Handler, HandlerContext, load_handler

log = logging.getLogger(__name__)


def resolve_device(spec: str) -> str:
    """``auto`` -> ``cuda`` when torch sees a GPU, else ``cpu``; anything else is taken as given."""
    if spec != "auto":
        return spec
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class Service:
    """``with Service(config) as service: service.wait_ready(30)`` runs kinference in this process."""

    def __init__(self, config: ServiceConfig, handler: Handler | None = None) -> None:
        self.config = config
        self.handler = handler if handler is not None else load_handler(config.handler)
        self.tracker = OffsetTracker()
        self.metrics = Metrics()
        self.endpoints: Endpoints | None = None
        self._model_ready = False
        self._started = False
        self._stopped = threading.Event()
        self.publisher: Publisher | TransactionalPublisher | None = None
        self.batcher: Batcher | None = None
        self.pipeline: Pipeline | None = None
        self.source: Source | None = None

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
            raise

    def _start(self, config: ServiceConfig) -> Service:
        device = resolve_device(config.device)
        if config.torch_threads is not None:
            import torch

            torch.set_num_threads(config.torch_threads)
        self.handler.setup(HandlerContext(device=device, model=_path(config.model),
                                          options=dict(config.handler_options),
                                          max_batch_size=config.micro_batch_size or config.max_batch_size))
        try:
            self._build(config)
        except KafkaException as exc:
            raise ConfigError(f"the Kafka client configuration was rejected: {exc.args[0].str()}") from exc
        self.pipeline.start()  # type: ignore[union-attr]  # returns once the inference threads warmed up
        self._model_ready = True
        self.metrics.model.info(self.handler.describe())
        log.info("handler ready: %s", self.handler.describe())
        self.publisher.start()  # type: ignore[union-attr]
        self.source.start()  # type: ignore[union-attr]
        self._started = True
        log.info("serving %s -> %s (group %s, %s batching, max batch %d, %s)", ",".join(config.request_topics),
                 config.reply_topic, config.group_id, config.batch_policy, config.max_batch_size, config.delivery)
        return self

    def _build(self, config: ServiceConfig) -> None:
        # Everything in flight fits in the publisher's queue, so the poll thread never blocks on it.
        queue_size = config.max_in_flight + config.max_poll_records
        if config.delivery == "exactly-once":
            self.publisher = TransactionalPublisher(
                config.producer_config(),
                config.transactional_id or f"kinference-{config.group_id}-{uuid.uuid4().hex[:12]}",
                config.dead_letter_topic,
                self.tracker,
                group_metadata=lambda: self.source.group_metadata(),  # type: ignore[union-attr]
                queue_size=queue_size,
                metrics=self.metrics,
                commit_interval_s=config.commit_interval_ms / 1000,
            )
        else:
            self.publisher = Publisher(
                config.producer_config(),
                config.dead_letter_topic,
                on_answered=self.tracker.finish,
                queue_size=queue_size,
                metrics=self.metrics,
                stall_timeout_s=config.producer_stall_timeout_s,
            )
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
        )
        decoder = RequestDecoder(config.reply_topic, config.max_request_bytes, self.handler.payload_format,
                                 config.max_header_bytes)
        transaction_commit = self.publisher.commit_now if isinstance(self.publisher, TransactionalPublisher) else None
        self.source = Source(config, decoder, self.tracker, self._route, self.batcher.discard, self.metrics,
                             transaction_commit)

    def wait_ready(self, timeout_s: float) -> bool:
        """True once the consumer has its partitions (handler loaded, threads running)."""
        return self.source is not None and self.source.assigned.wait(timeout_s)

    def health_checks(self) -> dict[str, bool]:
        """What ``/healthz`` reports: every thread alive (before start: only that the process is)."""
        if not self._started:
            return {"process": True}
        return {
            "source": self.source.alive,  # type: ignore[union-attr]
            "stages": self.pipeline.healthy,  # type: ignore[union-attr]
            "publisher": self.publisher.alive,  # type: ignore[union-attr]
        }

    def readiness_checks(self) -> dict[str, bool]:
        """What ``/readyz`` reports."""
        source = self.source
        return {
            "model_loaded": self._model_ready,
            "partitions_assigned": source is not None and source.assigned.is_set(),
            "broker_reachable": source is not None and source.broker_up,
            "healthy": self.healthy,
        }

    @property
    def healthy(self) -> bool:
        return self._started and all(self.health_checks().values())

    def stop(self, grace_s: float | None = None) -> None:
        """Stop consuming, drain in-flight work within ``grace_s``, flush replies, commit, close."""
        if not self._started or self._stopped.is_set():
            return
        self._stopped.set()
        grace_s = self.config.shutdown_grace_s if grace_s is None else grace_s
        deadline = time.monotonic() + grace_s
        assert self.source and self.pipeline and self.publisher and self.batcher
        self.source.drain()
        if not self.tracker.wait_idle(grace_s):
            log.warning("shutdown grace of %.1f s ran out with %d requests in flight; they stay "
                        "uncommitted and are served again after restart", grace_s, self.tracker.in_flight)
        self.batcher.close()
        self.pipeline.stop(_remaining(deadline, 5.0))
        self.publisher.stop(_remaining(deadline, 5.0))
        self.source.close(_remaining(deadline, 10.0))
        self.handler.close()
        if self.endpoints is not None:
            self.endpoints.close()
        log.info("stopped")

    def _route(self, request: Request) -> None:
        if request.ok:
            admit(self.handler, request)
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


def _remaining(deadline: float, floor_s: float) -> float:
    """Time left of the grace period, but never less than ``floor_s`` for the final flush/commit."""
    return max(floor_s, deadline - time.monotonic())
