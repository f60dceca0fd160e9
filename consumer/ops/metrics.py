"""Prometheus metrics of one service instance (its own registry, so several can share a process).

With ``--workers N`` each worker's metrics go to files under ``PROMETHEUS_MULTIPROC_DIR`` and the supervisor serves
their sum (``supervisor``); ``multiprocess_mode`` says how a gauge adds up across the live workers.

Every name starts with ``kinference_``. Labels are bounded: topics and models come from the configuration,
partitions from the current assignment (removed on revoke), outcomes from ``ErrorCode`` plus ``ok``. Every
metric of requests, batches and stages has a ``model`` label (the model that served them; ``none`` for a record
no model served); those of the Kafka clients, which the models share, have none.
"""

from __future__ import annotations

import bisect
import platform
from collections import Counter as Tally
from collections.abc import Iterable
from importlib import metadata
from typing import Any

import confluent_kafka
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector

from kinference import __version__

# Seconds, from sub-millisecond echo round trips to multi-second model batches.
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
_TOKEN_BUCKETS = (16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
UNSERVED_LABEL = "none"
"""The ``model`` label of a request that no model served (unreadable, or naming a model not served here)."""


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("kinference_requests", "Requests answered, by request topic and outcome "
                                "(ok or an error code).", ["model", "topic", "outcome"], registry=r)
        self.batch_size = Histogram("kinference_batch_size", "Requests per dispatched batch.", ["model"],
                                    buckets=_SIZE_BUCKETS, registry=r)
        self.batch_padded_tokens = Histogram("kinference_batch_padded_tokens", "Tokens per micro-batch after "
                                             "padding (longest x count), for handlers that report tokens.",
                                             ["model"], buckets=_TOKEN_BUCKETS, registry=r)
        self.batch_real_tokens = Counter("kinference_batch_real_tokens", "Tokens before padding; "
                                         "padded/real is the padding ratio.", ["model"], registry=r)
        self.batch_cost_fixed = Gauge("kinference_batch_cost_fixed_seconds", "Learned fixed cost of one inference "
                                      "call (what the adaptive policy weighs against waiting); NaN until learned.",
                                      ["model"], registry=r)
        self.batch_cost_per_unit = Gauge("kinference_batch_cost_per_unit_seconds", "Learned cost of each padded "
                                         "token (or request, for handlers that count no tokens) of an inference "
                                         "call; NaN until learned.", ["model"], registry=r)
        self.queue_wait = Histogram("kinference_queue_wait_seconds", "From receipt by the consumer to dispatch "
                                    "in a batch.", ["model", "topic"], buckets=_LATENCY_BUCKETS, registry=r)
        self.stage_seconds = Histogram("kinference_stage_seconds", "Duration of one stage call for one "
                                       "micro-batch.", ["model", "stage"], buckets=_LATENCY_BUCKETS, registry=r)
        self.service_seconds = Histogram("kinference_service_seconds", "From receipt by the consumer to the "
                                         "reply handed to the producer.", ["model", "topic"], buckets=_LATENCY_BUCKETS,
                                         registry=r)
        self.in_flight = Gauge("kinference_in_flight", "Requests consumed and not yet answered.", registry=r,
                               multiprocess_mode="livesum")
        self.in_flight_bytes = Gauge("kinference_in_flight_bytes", "What requests in flight hold decoded, as "
                                     "--max-in-flight-bytes counts it.", registry=r, multiprocess_mode="livesum")
        self.paused_partitions = Gauge("kinference_paused_partitions", "Assigned partitions paused by "
                                       "backpressure or shutdown.", registry=r, multiprocess_mode="livesum")
        self.assigned_partitions = Gauge("kinference_assigned_partitions", "Partitions assigned to this member.",
                                         registry=r, multiprocess_mode="livesum")
        self.commits = Counter("kinference_commits", "Offset commits that succeeded.", registry=r)
        self.commit_failures = Counter("kinference_commit_failures", "Offset commits that failed (retried "
                                       "at the next commit).", registry=r)
        self.share_acknowledgements = Counter("kinference_share_acknowledgements", "Records a share group member "
                                              "acknowledged, by kind: accept (answered), reject (error reply and "
                                              "dead letter), release (left unanswered: delivered again).",
                                              ["kind"], registry=r)
        self.replies = Counter("kinference_replies", "Replies acknowledged by the broker, by reply status.",
                               ["status"], registry=r)
        self.delivery_failures = Counter("kinference_delivery_failures", "Replies or dead letters the broker "
                                         "refused, by kind.", ["kind"], registry=r)
        self.producer_replacements = Counter("kinference_producer_replacements", "Producers replaced after a "
                                             "fatal error (e.g. fenced after a broker restart).", registry=r)
        self.dead_letters = Counter("kinference_dead_letters", "Records written to the dead-letter topic.",
                                    registry=r)
        self.unanswerable = Counter("kinference_unanswerable_requests", "Requests whose reply or dead letter the "
                                    "broker refused for good, even cut down: answered without it (or not at all), "
                                    "logged, and committed past.", registry=r)
        self.rebalance_dropped = Counter("kinference_rebalance_dropped_requests", "Requests of revoked partitions "
                                         "dropped before they were computed: the partitions' next owner serves "
                                         "them again (the work a rebalance costs).", registry=r)
        self.consumer_lag = Gauge("kinference_consumer_lag", "End offset minus the group's committed offset, per "
                                  "assigned partition (what KEDA's Kafka scaler computes), refreshed from the broker "
                                  "every lag_interval_s.", ["topic", "partition"], registry=r,
                                  multiprocess_mode="livemostrecent")
        self.ready = Gauge("kinference_ready", "1 while /readyz would answer 200 (model loaded, in the group, a "
                           "broker reachable, healthy), else 0; read at each scrape.", registry=r)
        self.healthy = Gauge("kinference_healthy", "1 while /healthz would answer 200 (every thread alive, no fatal "
                             "client error), else 0; read at each scrape.", registry=r)
        self.fatal_errors = Counter("kinference_fatal_errors", "Fatal librdkafka errors, by client: the consumer's "
                                    "stops the service (exit code 1, the orchestrator restarts it), the producer's "
                                    "replace the producer.", ["client"], registry=r)
        for client in ("consumer", "producer"):
            self.fatal_errors.labels(client)  # a zero before the first one, so that increase() sees it
        # process_start_time_seconds: restarts (a fatal consumer error ends the process) show as its changes.
        ProcessCollector(registry=r)
        self.model = Info("kinference_model", "Each model being served: its handler's description.", ["model"],
                          registry=r)
        # Generative models (consumer/path/generations.py).
        self.generation_active = Gauge("kinference_generation_active_sequences", "Requests the engine is "
                                       "generating now.", ["model"], registry=r)
        self.generation_queued = Gauge("kinference_generation_queued_prompts", "Requests waiting for a place in "
                                       "the engine.", ["model"], registry=r)
        self.generated_tokens = Counter("kinference_generated_tokens", "Tokens generated; its rate is tokens per "
                                        "second.", ["model"], registry=r)
        self.time_to_first_token = Histogram("kinference_time_to_first_token_seconds", "From receipt by the "
                                             "consumer to the first generated token.", ["model"],
                                             buckets=_LATENCY_BUCKETS, registry=r)
        self.kv_cache_use = Gauge("kinference_kv_cache_use_ratio", "Fraction of the engine's KV cache in use.",
                                  ["model"], registry=r)
        self.build = Info("kinference_build", "Versions of kinference and of what it runs on.", registry=r)
        self.build.info(build_info())
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}

    def labelled(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, kept: prometheus_client validates the labels and takes a lock on every
        ``labels()`` call, which the per-request path pays several times. For label sets that are never removed
        (topics from the configuration, outcomes, statuses)."""
        key = (metric, values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child


def build_info() -> dict[str, str]:
    """kinference's version and its runtime's: what a dashboard needs to tell deployments apart."""
    versions = {"version": __version__, "python": platform.python_version(),
                "librdkafka": confluent_kafka.libversion()[0]}
    for package in ("confluent-kafka", "torch", "transformers"):
        try:
            versions[package.replace("-", "_")] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package.replace("-", "_")] = "none"
    return versions


def observe_many(histogram: Any, amounts: Iterable[float]) -> None:
    """``histogram.observe(amount)`` for each amount (a labelled child), with one update of each bucket that
    changes and of the sum, instead of a lock per bucket walk per amount: the publisher observes every request,
    and prometheus_client's ``observe`` walks the bucket bounds in Python (a request that waited in a backlog
    passes most of them). It reads the child's ``_upper_bounds``, ``_buckets`` and ``_sum``, which
    prometheus_client has kept since 0.4 and its multiprocess values share; ``tests/unit/consumer/ops/test_metrics.py``
    checks that the result equals ``observe``'s."""
    bounds = histogram._upper_bounds
    amounts = list(amounts)
    if not amounts:
        return
    histogram._sum.inc(sum(amounts))
    for index, count in Tally(bisect.bisect_left(bounds, amount) for amount in amounts).items():
        histogram._buckets[index].inc(count)
