"""The one configuration object of the service, and how it is loaded.

Every field has a default, an env var (``KINFERENCE_`` + the field name upper-cased), a CLI flag
(``--`` + the field name with dashes) and a YAML key (the field name); ``OPTIONS`` lists them. The batching
fields live in one ``Batching`` model, which the service (``ServiceConfig.batching``) and each of several models
(``ModelSpec``) share, yet stay top-level options outside. Precedence, highest first: CLI flag, env var, YAML file
(``--config``), the model's own batch settings (its handler's ``batching_defaults``: a TorchServe archive's),
default. ``ServiceConfig`` is frozen and validated at construction, so a bad value fails at start with a
message that names the field.
"""

from __future__ import annotations

import fnmatch
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import orjson
import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo

from kinference.errors import ConfigError, HandlerLoadError
from kinference.protocol import _NEXT_PAIR

if TYPE_CHECKING:
    from kinference.handlers import Handler

ENV_PREFIX = "KINFERENCE_"

# librdkafka settings kinference relies on; users may override any other property.
_CONSUMER_DEFAULTS = {
    "enable.auto.commit": "false",
    "enable.auto.offset.store": "false",
    "auto.offset.reset": "earliest",
    # A resume refills the prefetch queue at once instead of after librdkafka's default 1 s back-off.
    "fetch.queue.backoff.ms": "10",
    # Prefetched records wait here while partitions are paused: bound them well below librdkafka's 64 MiB.
    "queued.max.messages.kbytes": "16384",
    # Statistics tell /readyz whether a broker connection is up, without extra broker requests.
    "statistics.interval.ms": "5000",
}
_PRODUCER_DEFAULTS = {
    "enable.idempotence": "true",
    "acks": "all",
    "linger.ms": "2",
    "compression.type": "lz4",
    # A reply is produced only to a topic that exists (topic_metadata), and the producer's metadata requests must
    # never create one either: librdkafka's producer default is true.
    "allow.auto.create.topics": "false",
}
# The classic group protocol's assignor: incremental, so a rebalance moves only the partitions that change
# owner and the others keep being served. KIP-848's protocol (group.protocol=consumer) assigns on the broker
# and is always incremental; it refuses this property.
_CLASSIC_ASSIGNOR = {"partition.assignment.strategy": "cooperative-sticky"}
# Properties whose meaning kinference's commit rule depends on: overriding them would silently lose data.
_PINNED_CONSUMER = {"enable.auto.commit": "false", "enable.auto.offset.store": "false"}
# Producer properties whose weaker values would give up what the delivery modes promise.
_PINNED_PRODUCER = {"acks": ("all", "-1"), "enable.idempotence": ("true",)}
_LIBRDKAFKA_DELIVERY_TIMEOUT_MS = 300_000
INTERNAL_TOPICS = ("__", "_schemas", "_confluent")
"""Name prefixes of the topics that Kafka (``__consumer_offsets``, ``__transaction_state``...), Schema Registry
(``_schemas``) and Confluent's components (``_confluent-...``) keep their own state in: never a reply topic."""
# Properties that first-class options set: a pass-through copy would silently win over the option.
_OWNED_PROPERTIES = {
    "bootstrap.servers": "bootstrap_servers",
    "group.id": "group_id",
    "transactional.id": "transactional_id",
}


class Parallelism(BaseModel):
    """Threads per stage. Inference threads share one handler instance (one copy of the weights)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    preprocess: int = Field(1, ge=1, le=64)
    inference: int = Field(1, ge=1, le=64)
    postprocess: int = Field(1, ge=1, le=64)


def _split_csv(value: Any) -> Any:
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    return value


def _parallelism(value: Any) -> Any:
    """``preprocess=2,inference=1`` from a flag or env var, or a mapping (YAML, JSON)."""
    value = _key_values(value) if isinstance(value, str) else value
    return {k: int(v) for k, v in value.items()} if isinstance(value, dict) else value


def _key_values(value: Any) -> Any:
    """Accept a mapping, a JSON object, or ``key=value`` items: a list (one item per repeated flag, never
    split) or one string (an env var), split where the next ``key=`` starts."""
    if isinstance(value, str):
        stripped = value.strip()
        if stripped.startswith("{"):
            return orjson.loads(stripped)
        value = [item for item in _NEXT_PAIR.split(stripped) if item.strip()]
    if isinstance(value, list):
        pairs = {}
        for item in value:
            key, sep, raw = str(item).partition("=")
            if not sep or not key.strip():
                # Never echo the item: it may be a mistyped secret (sasl.password:...).
                raise ValueError(f"expected key=value, got an item of {len(str(item))} characters without '='")
            pairs[key.strip()] = raw.strip()
        return pairs
    return value


class Batching(BaseModel):
    """How one model's requests are batched and run: the batcher's policy and limits, and the stage threads.

    ``ServiceConfig.batching`` holds the service's; a ``models`` entry may override any field for its model.
    Outside, each field is a top-level option like any other (``--max-batch-size``, ``KINFERENCE_MAX_BATCH_SIZE``,
    ``max_batch_size:``), in a ``models`` entry too: ``_fold_batching`` moves them in here."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    batch_policy: Literal["adaptive", "greedy", "static"] = Field(
        "adaptive",
        description="adaptive: dispatch at once unless the learned batch cost says waiting raises "
        "throughput within target_latency_ms; greedy: dispatch as soon as inference has room; static: wait "
        "for a full batch or max_batch_delay_ms (TorchServe).",
    )
    max_batch_size: int = Field(32, ge=1, le=4096, description="Most requests in one batch.")
    max_batch_tokens: int | None = Field(
        8192, ge=1, description="Most padded tokens (longest x count) in one batch, for handlers that count "
        "tokens; waiting requests are then grouped by length (0 or none: count requests only).",
    )
    max_batch_delay_ms: float = Field(
        20.0, ge=0, le=60_000, description="static: longest wait for a full batch, from the oldest arrival; "
        "adaptive: longest a batch is held open.",
    )
    target_latency_ms: float = Field(
        100.0, gt=0, le=600_000, description="adaptive: hold a batch open only while its oldest request "
        "can still be answered within this.",
    )
    max_batch_bytes: int | None = Field(
        8_388_608, ge=1, description="Most bytes of request values in one batch (a larger request runs alone)."
    )
    micro_batch_size: int | None = Field(
        None, ge=1, description="Split batches into micro-batches of this size (default: no split)."
    )
    parallelism: Parallelism = Field(Parallelism(), description="Threads per stage.")
    handler_timeout_s: float = Field(
        300.0, gt=0, le=86_400, description="The longest one preprocess, inference or postprocess call may run: "
        "past it the micro-batch's requests get handler_timeout (and are dead-lettered), and the model is unhealthy "
        "(/healthz 503 naming it; kinference serve exits 1). The default leaves room for a first CUDA or "
        "torch.compile compile of a new batch shape and for a cold cache.",
    )

    _parallelism_pairs = field_validator("parallelism", mode="before")(_parallelism)

    @field_validator("max_batch_tokens", mode="before")
    @classmethod
    def _no_token_budget(cls, value: Any) -> Any:
        """``0`` or ``none`` turns the token budget off (a flag or env var cannot say null)."""
        return None if value in (0, "0") or (isinstance(value, str) and value.lower() in ("none", "null")) else value

    @model_validator(mode="after")
    def _micro_batches_fit(self) -> Batching:
        if self.micro_batch_size is not None and self.micro_batch_size > self.max_batch_size:
            raise ValueError(
                f"micro_batch_size ({self.micro_batch_size}) must not exceed max_batch_size "
                f"({self.max_batch_size})"
            )
        return self


def _fold_batching(data: Any) -> Any:
    """Move the top-level batching fields of a config's input (``max_batch_size: 4``) into its ``batching``
    mapping, over what that already holds."""
    if not isinstance(data, Mapping) or not data.keys() & Batching.model_fields.keys():
        return data
    given = data.get("batching", {})
    if isinstance(given, Batching):
        given = given.model_dump(exclude_unset=True)  # what was set stays set: over the handler's defaults
    if not isinstance(given, Mapping):
        return data  # the field's own validation says what is wrong
    flat = {key: value for key, value in data.items() if key in Batching.model_fields}
    return {**{key: value for key, value in data.items() if key not in flat}, "batching": {**given, **flat}}


class ModelSpec(BaseModel):
    """One of several models served by one process (``models``). Each has its own handler, batcher and stage
    threads; every batching field left out (null) is the service's own (``--max-batch-size``...)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, pattern=r"^[^\s,]+$")
    version: str | None = Field(None, min_length=1)
    handler: str = "embedding"
    model: Path | None = None
    handler_options: dict[str, Any] = {}
    request_topics: list[str] = []
    """Request topics whose records this model serves unless a record names another (``kinference-model``)."""
    batching: dict[str, Any] = {}
    """This model's own batching fields, given flat like the service's (``max_batch_size: 4``); each one left out
    or null is the service's. Validated with the service's, as one ``Batching``, by ``ServiceConfig``."""

    _fold = model_validator(mode="before")(_fold_batching)

    @field_validator("batching")
    @classmethod
    def _overrides(cls, overrides: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(overrides.keys() - Batching.model_fields.keys())
        if unknown:
            raise ValueError(f"not batching fields: {', '.join(unknown)}")
        return {key: value for key, value in overrides.items() if value is not None}

    _split = field_validator("request_topics", mode="before")(_split_csv)
    _pairs = field_validator("handler_options", mode="before")(_key_values)


_MODEL_FIELDS = ("handler", "model", "handler_options", "model_name", "model_version")
"""The service's single-model fields: with ``models`` each model sets its own."""


Csv = Annotated[list[str], Field(min_length=1)]
_MERGED = ("kafka", "kafka_consumer", "kafka_producer", "handler_options", "schema_registry", "topic_config")
_LIBRDKAFKA_MESSAGE_MAX_BYTES = 1_000_000
_DEAD_LETTER_OVERHEAD = 4096  # kinference's own dead-letter headers and the record framing
# SchemaRegistryClient properties that it takes as numbers, not strings.
_REGISTRY_NUMBERS = frozenset({"timeout", "cache.capacity", "cache.latest.ttl.sec", "max.retries", "retries.wait.ms",
                               "retries.max.wait.ms"})


class ServiceConfig(BaseModel):
    """All settings of ``kinference serve``. See docs/configuration.md for the full table."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    # --- Kafka
    bootstrap_servers: str = Field("127.0.0.1:9092", min_length=1, description="Kafka bootstrap servers.")
    request_topics: Csv = Field(["kinference-requests"], description="Request topics, comma-separated.")
    reply_topic: str = Field("kinference-replies", min_length=1, description="Default reply topic.")
    dead_letter_topic: str = Field(
        "kinference-dead-letters", min_length=1, description="Topic for records that are not valid requests."
    )
    group_id: str = Field("kinference", min_length=1, description="Consumer group id.")
    control_topic: str | None = Field(
        None, min_length=1, description="Generative models: a topic every member reads for cancels, records "
        "{\"cancel\": \"<correlation id>\"}; the generation stops with finish_reason cancelled (default: none).",
    )
    kafka: dict[str, SecretStr] = Field(
        {}, description="librdkafka properties for consumer and producer (key=value; repeatable)."
    )
    kafka_consumer: dict[str, SecretStr] = Field({}, description="librdkafka properties, consumer only.")
    kafka_producer: dict[str, SecretStr] = Field({}, description="librdkafka properties, producer only.")
    embedded_broker: bool = Field(
        False, description="Start the embedded Tansu broker on a free loopback port and use it."
    )

    # --- Model
    handler: str = Field(
        "embedding", description="echo, embedding, text-classification, rerank, sparse, image-classification, "
        "torchserve, sim, generate, or module:Class.",
    )
    model: Path | None = Field(
        None, description="Local model directory, or file for image-classification and torchserve (a .mar) "
        "(default: the handler's own).",
    )
    handler_options: dict[str, Any] = Field({}, description="Handler settings (key=value; repeatable).")
    device: str = Field("auto", description="auto (CUDA when available), cpu, cuda or cuda:N.")
    request_format: Literal["auto", "kinference", "oip"] = Field(
        "auto", description="auto: a record with the mlserver-model header is an Open Inference Protocol (V2) "
        "request, any other kinference's JSON; oip: every record is OIP; kinference: never OIP.",
    )
    model_name: str | None = Field(
        None, description="The model's name in OIP requests (mlserver-model) and responses (default: the "
        "handler's model name, else the handler).",
    )
    model_version: str | None = Field(
        None, description="The model's version in replies (kinference-model-version, OIP's model_version); a "
        "request naming another (kinference-model-version, mlserver-version) gets model_not_found (default: none, "
        "any version accepted).",
    )
    models: list[ModelSpec] = Field(
        [], description="Several models in one process, as a JSON list (or a YAML list): each {name, version, "
        "handler, model, handler_options, request_topics, and any batching field to override}. A record goes to "
        "the model its kinference-model (or mlserver-model) header names, else its topic's, else the first "
        "(default: one model, from --handler and --model).",
    )

    # --- Schema Registry
    value_format: Literal["json", "avro", "protobuf", "jsonschema"] = Field(
        "json", description="Request and reply values: json (kinference's JSON), or avro, protobuf or jsonschema "
        "through the Schema Registry (pip install 'kinference[schema-registry]'; OIP requests are JSON only).",
    )
    schema_registry_url: str | None = Field(
        None, description="The Schema Registry's URL; needed by every value_format but json.",
    )
    schema_registry: dict[str, SecretStr] = Field(
        {}, description="SchemaRegistryClient properties: basic.auth.user.info, ssl.ca.location... (key=value; "
        "repeatable).",
    )
    subject_name_strategy: Literal["topic", "record", "topic-record"] = Field(
        "topic", description="Subject of a schema: <topic>-value, the record's full name, or <topic>-<record name>.",
    )
    schema_id_location: Literal["prefix", "header"] = Field(
        "prefix", description="Where replies carry their schema id: the value's prefix (Confluent wire format) or "
        "the __value_schema_id header (its GUID); requests are read either way.",
    )
    auto_register_schemas: bool = Field(
        True, description="Register kinference's reply schema under the reply topic's subject "
        "(--no-auto-register-schemas: it must be registered already).",
    )
    schema_registry_miss_ttl_s: float = Field(
        30.0, gt=0, description="A schema id the Schema Registry did not find (or failed to look up) is not asked "
        "about again for this long: its records get the same error at once.",
    )

    # --- Batching
    batching: Batching = Field(Batching(), description="How requests are batched and run: the options "
                               "batch_policy to handler_timeout_s, each given on its own (--max-batch-size...).")
    torch_threads: int | None = Field(
        None, ge=1, le=1024, description="torch intra-op threads (default: torch's own, one per core).",
    )

    # --- Delivery
    delivery: Literal["at-least-once", "exactly-once"] = Field(
        "at-least-once",
        description="at-least-once: replies, then offsets; exactly-once: replies and offsets in one "
        "transaction (clients read replies with isolation.level=read_committed).",
    )
    group_type: Literal["consumer", "share"] = Field(
        "consumer",
        description="consumer: a consumer group, partitions assigned to members, offsets committed; share: a "
        "KIP-932 share group (Apache Kafka 4.2+), members share partitions and acknowledge each record (accepted "
        "once answered, rejected with a dead letter, released for redelivery when left unanswered). "
        "at-least-once only.",
    )
    transaction_call_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="exactly-once: how long one call of the transactional API (send "
        "offsets, commit, abort) may take; one that times out is made again, as librdkafka prescribes.",
    )
    transactional_id: str | None = Field(
        None, min_length=1, description="exactly-once: the producer's transactional.id, unique per live member "
        "(default: stable per member: from group.instance.id when set, else from the group, the host name and a "
        "slot per host, so a restarted member fences its own predecessor at once).",
    )

    # --- Flow control and limits
    max_in_flight: int = Field(
        2048, ge=1, description="Requests consumed but not yet committed; above it partitions pause."
    )
    max_in_flight_bytes: int = Field(
        536_870_912, ge=1, description="Bytes that requests consumed and not yet answered may hold once decoded (a "
        "JSON value takes 2-40x its size in Python objects, estimated from its bytes); above it partitions pause, "
        "at half they resume. Beside --max-in-flight: whichever is reached first.",
    )
    resume_in_flight: int | None = Field(
        None, ge=0, description="Resume paused partitions at or below this (default: max_in_flight / 2)."
    )
    max_poll_records: int = Field(500, ge=1, le=100_000, description="Most records taken per poll.")
    max_request_bytes: int = Field(960_000, ge=1, description="Larger request values get payload_too_large.")
    max_header_bytes: int = Field(16_384, ge=1, description="Larger request headers get payload_too_large.")
    max_key_bytes: int = Field(4096, ge=1, description="Larger request keys get payload_too_large, and the reply "
                               "and dead letter go without the key (header kinference-key-omitted).")
    max_sequences_per_partition: int = Field(
        16, ge=1, description="Generative models: the most requests of one partition generated at once (the engine's "
        "own max_sequences bounds them all); the others wait, in order.",
    )
    stream_every_tokens: int = Field(
        8, ge=1, description="Generative models, \"stream\": true: after the first chunk (sent at once), one "
        "chat.completion.chunk record every this many tokens...",
    )
    stream_every_ms: float = Field(
        100.0, gt=0, description="...or every this many milliseconds, whichever comes first.",
    )
    max_queue_ms: float | None = Field(
        None, gt=0, description="Shed requests older than this (since written to Kafka) with overloaded "
        "(default: never shed).",
    )
    reply_topics_allowed: list[str] = Field(
        [], description="Reply topics a request may name besides --reply-topic: names or shell-style patterns "
        "(replies-*), comma-separated. The request and dead-letter topics and internal topics (__*, _schemas, "
        "_confluent*) are never allowed; an allowed topic that does not exist gets reply_topic_not_found.",
    )
    commit_interval_ms: int = Field(1000, ge=10, description="How often acknowledged offsets are committed.")
    rebalance_drain_ms: int = Field(
        5000, ge=0, description="On revoke, how long to wait for in-flight replies before committing."
    )
    shutdown_grace_s: float = Field(
        30.0, ge=1, description="On SIGTERM, the deadline of the whole shutdown: drain in-flight work, flush "
        "replies, commit and leave the group within it (keep it below terminationGracePeriodSeconds).",
    )
    delivery_retry_timeout_s: float = Field(
        600.0, gt=0, description="How long a reply or dead letter that failed for a passing reason (timed out "
        "in a broker outage) is produced again; past it the service stops with exit code 1.",
    )
    producer_stall_timeout_s: float | None = Field(
        None, gt=0, description="Replace the producer after no successful delivery for this long with records "
        "outstanding (default: librdkafka's delivery timeout, message.timeout.ms, plus 30 s; never when "
        "message.timeout.ms is 0, no limit).",
    )
    lag_interval_s: float = Field(
        5.0, gt=0, le=3600, description="How often kinference_consumer_lag is refreshed from the broker.",
    )

    # --- Topics: what `kinference topics create` makes (serve reads them too, and ignores them)
    partitions: int = Field(
        6, ge=1, le=100_000, description="kinference topics create: partitions per request topic, the most members "
        "that can share the work.",
    )
    reply_partitions: int | None = Field(
        None, ge=1, le=100_000, description="kinference topics create: partitions of the reply topic (default: as "
        "partitions).",
    )
    dead_letter_partitions: int = Field(
        1, ge=1, le=100_000, description="kinference topics create: partitions of the dead-letter topic.",
    )
    replication_factor: int = Field(
        -1, ge=-1, le=100, description="kinference topics create: replicas of each topic (-1: the broker's "
        "default.replication.factor).",
    )
    topic_config: dict[str, str] = Field(
        {}, description="kinference topics create: topic configs of the topics it makes (retention.ms, "
        "min.insync.replicas, max.message.bytes...; key=value; repeatable).",
    )

    # --- Operation
    workers: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = Field(
        "auto", description="Worker processes on this host, each a member of the consumer group, under one "
        "supervisor that restarts them and serves one /metrics, /healthz and /readyz. auto: with a device process, as "
        "many as its start-up calibration says the device can absorb, within the cores; without one, 1 (one process, "
        "no supervisor). Without a device process each worker has its own copy of the model. See "
        "docs/configuration.md#the-device-process-and-workers.",
    )
    device_process: Literal["auto", "on", "off"] = Field(
        "auto", description="Run the model in one device process per GPU, fed by the workers, which do the "
        "per-message work: one copy of the weights per GPU, batches merged across workers. auto: on when the "
        "device is CUDA, off on the CPU (measured: docs/benchmarks.md).",
    )
    device_batch_size: Annotated[int, Field(ge=1, le=4096)] | Literal["auto"] = Field(
        "auto", description="The most items in one batch of the device process (micro-batches of the workers "
        "merged). auto: the smallest batch size within a tenth of the best items/s in the start-up calibration.",
    )
    device_threads: int = Field(
        2, ge=1, le=16, description="Device batches the device process runs at once (each on the CUDA stream of "
        "the thread that runs it): one merges or hands back while another's batch runs.",
    )
    device_in_flight: int = Field(
        2, ge=1, le=64, description="Micro-batches each worker keeps at its device process (its inference threads, "
        "which wait for the device): 2 keeps the next one there while one runs.",
    )
    device_arena_mb: int = Field(
        64, ge=1, le=65_536, description="Shared memory per worker inference thread for its micro-batch's tensors "
        "(half in, half out), taken only as written.",
    )
    device_wait_s: float = Field(
        120.0, gt=0, le=86_400, description="How long a worker waits for its device process to answer (it is "
        "restarted if it died, and the call is sent again) before that micro-batch fails with handler_error.",
    )
    device_hang_s: Annotated[float, Field(gt=0, le=86_400)] | Literal["auto"] = Field(
        "auto", description="The one progress rule: a device batch running longer than this has hung (its requests "
        "fail with device_hung, /healthz turns red and the device process is replaced), and so has a generative "
        "model's engine that holds requests and makes no decoding step for this long (its requests fail with "
        "handler_error and the engine is replaced in its process, /healthz red until the new one runs), and a "
        "worker whose report is silent this long, at least 20 s (killed and started again). auto: 10 "
        "times the slowest batch of the start-up calibration, at least 30 s; an engine's, 60 s (above a long "
        "prompt's prefill).",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Log level.")
    log_format: Literal["text", "json"] = Field(
        "text", description="text, or json: one object per line with topic/partition/offset/correlation_id."
    )
    metrics: bool = Field(True, description="Serve /metrics, /healthz and /readyz (--no-metrics: off).")
    metrics_host: str = Field(
        "0.0.0.0", description="Bind address of /metrics, /healthz and /readyz: every interface, for Prometheus and "
        "Kubernetes probes from outside the pod; 127.0.0.1 where only the host itself may read them (see "
        "docs/security.md#the-metrics-and-health-endpoint).",
    )
    metrics_port: int = Field(
        9400, ge=0, le=65535, description="Port of /metrics, /healthz and /readyz (0: any free port)."
    )
    metrics_max_connections: int = Field(
        64, ge=1, le=10_000, description="Most connections the /metrics, /healthz and /readyz server holds open; "
        "past it the oldest idle one is closed.",
    )
    metrics_timeout_s: float = Field(
        10.0, gt=0, le=3600, description="The /metrics, /healthz and /readyz server closes a connection that sends "
        "no request within this, and bounds each read and write of a request by it.",
    )
    tracing: bool = Field(
        False, description="Record an OpenTelemetry span per request, exported as the OTEL_* environment variables "
        "say (pip install 'kinference[otel]'; docs/tracing.md).",
    )

    _fold = model_validator(mode="before")(_fold_batching)
    _split = field_validator("request_topics", "reply_topics_allowed", mode="before")(_split_csv)
    _pairs = field_validator("handler_options", mode="before")(_key_values)

    @field_validator("topic_config", mode="before")
    @classmethod
    def _topic_config_strings(cls, value: Any) -> Any:
        """Topic configs are strings to the broker: ``retention.ms: 86400000`` from YAML becomes ``"86400000"``."""
        value = _key_values(value)
        if isinstance(value, dict):
            return {key: ("true" if item else "false") if isinstance(item, bool) else str(item)
                    for key, item in value.items()}
        return value

    @field_validator("kafka", "kafka_consumer", "kafka_producer", "schema_registry", mode="before")
    @classmethod
    def _librdkafka_strings(cls, value: Any) -> Any:
        """librdkafka takes every property as a string: ``session.timeout.ms: 6000`` and ``true`` from YAML or
        JSON become ``"6000"`` and ``"true"``."""
        value = _key_values(value)
        if not isinstance(value, dict):
            return value
        converted = {}
        for key, item in value.items():
            if isinstance(item, bool):
                item = "true" if item else "false"
            elif isinstance(item, int | float):
                item = str(item)
            elif not isinstance(item, str | SecretStr):
                raise ValueError(f"{key} must be a string, a number or a boolean, not {type(item).__name__}")
            converted[key] = item
        return converted

    @field_validator("log_level", mode="before")
    @classmethod
    def _any_case(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value

    @field_validator("handler_options", mode="after")
    @classmethod
    def _json_values(cls, options: dict[str, Any]) -> dict[str, Any]:
        """``top_k=3`` from a flag arrives as a string; read it as JSON when it parses as such."""
        parsed = {}
        for key, value in options.items():
            try:
                parsed[key] = orjson.loads(value) if isinstance(value, str) else value
            except orjson.JSONDecodeError:
                parsed[key] = value
        return parsed

    @field_validator("models", mode="before")
    @classmethod
    def _models_json(cls, value: Any) -> Any:
        """``--models`` and ``KINFERENCE_MODELS`` give the list as JSON text."""
        if isinstance(value, str):
            try:
                return orjson.loads(value) if value.strip() else []
            except orjson.JSONDecodeError as exc:
                raise ValueError(f"models must be a JSON list of objects: {exc}") from exc
        return value

    @field_validator("request_topics")
    @classmethod
    def _distinct(cls, topics: list[str]) -> list[str]:
        if len(set(topics)) != len(topics):
            raise ValueError("request topics must be distinct")
        return topics

    @model_validator(mode="after")
    def _check_topics(self) -> ServiceConfig:
        for topic in (self.reply_topic, self.dead_letter_topic):
            if topic in self.request_topics:
                raise ValueError(f"{topic!r} is both a request topic and a reply/dead-letter topic")
        return self

    @model_validator(mode="after")
    def _check_flow_control(self) -> ServiceConfig:
        if self.max_in_flight < self.batching.max_batch_size:
            raise ValueError(
                f"max_in_flight ({self.max_in_flight}) must be at least max_batch_size "
                f"({self.batching.max_batch_size}), or batches could never fill"
            )
        if self.resume_in_flight is not None and self.resume_in_flight >= self.max_in_flight:
            raise ValueError("resume_in_flight must be below max_in_flight")
        return self

    @model_validator(mode="after")
    def _check_record_sizes(self) -> ServiceConfig:
        message_max = int(self.producer_config().get("message.max.bytes", _LIBRDKAFKA_MESSAGE_MAX_BYTES))
        if self.dead_letter_max_bytes > message_max:
            raise ValueError(
                f"max_request_bytes + max_header_bytes + max_key_bytes ({self.max_request_bytes} + "
                f"{self.max_header_bytes} + {self.max_key_bytes}) "
                f"leaves no room under the producer's message.max.bytes ({message_max}) for the dead letter "
                "of a maximal request: lower them, or raise message.max.bytes (--kafka-producer) and the "
                "reply and dead-letter topics' max.message.bytes (--topic-config max.message.bytes=N)"
            )
        topic_max = self.topic_config.get("max.message.bytes")
        if topic_max is not None and (not topic_max.isdigit() or int(topic_max) < self.dead_letter_max_bytes):
            raise ValueError(
                f"topic_config max.message.bytes ({topic_max}) must hold the dead letter of a maximal request: "
                f"max_request_bytes + max_header_bytes + max_key_bytes + {_DEAD_LETTER_OVERHEAD} = "
                f"{self.dead_letter_max_bytes}; "
                "raise it, or lower max_request_bytes"
            )
        return self

    @model_validator(mode="after")
    def _check_kafka_properties(self) -> ServiceConfig:
        """Pass-through properties may not undo what the commit rule and the delivery modes rely on, nor
        shadow a first-class option."""
        for key, value in self.consumer_config().items():
            if key in _PINNED_CONSUMER and value != _PINNED_CONSUMER[key]:
                raise ValueError(f"{key} must stay {_PINNED_CONSUMER[key]}: kinference commits offsets itself")
        producer = self.producer_config()
        for key, allowed in _PINNED_PRODUCER.items():
            if producer.get(key, allowed[0]).lower() not in allowed:
                raise ValueError(f"{key} must stay {allowed[0]}: without it a reply can be lost or written twice "
                                 "by the producer's own retries")
        if producer["allow.auto.create.topics"].lower() != "false":
            raise ValueError("allow.auto.create.topics must stay false: a request's reply-to header would otherwise "
                             "create topics on a broker that allows it")
        for option in ("kafka", "kafka_consumer", "kafka_producer"):
            for key in getattr(self, option).keys() & _OWNED_PROPERTIES.keys():
                field = _OWNED_PROPERTIES[key]
                raise ValueError(
                    f"the Kafka property {key} is set by --{field.replace('_', '-')} "
                    f"({ENV_PREFIX}{field.upper()}, {field}: in YAML); remove it from {option}"
                )
        return self

    @model_validator(mode="after")
    def _check_exactly_once(self) -> ServiceConfig:
        if self.delivery != "exactly-once":
            return self
        if self.consumer_config().get("isolation.level", "").lower() == "read_uncommitted":
            raise ValueError(
                "isolation.level=read_uncommitted with delivery exactly-once would serve the requests of aborted "
                "producer transactions, requests that never happened, and commit their replies: remove it (the "
                "default read_committed), or use delivery at-least-once")
        if self.group_type == "share":
            raise ValueError("exactly-once commits offsets in the reply transaction, and a share group has no offsets "
                             "to commit (KIP-932 acknowledges records one by one, outside any transaction): use "
                             "--group-type share with --delivery at-least-once, or a consumer group for exactly-once")
        return self

    @model_validator(mode="after")
    def _check_producer_stall(self) -> ServiceConfig:
        if self.producer_stall_timeout_s is None:
            return self
        delivery_timeout_s = self.delivery_timeout_ms / 1000 or math.inf  # librdkafka: 0 is no limit
        if delivery_timeout_s == math.inf:
            raise ValueError(
                "producer_stall_timeout_s cannot be set with message.timeout.ms=0: librdkafka then never times a "
                "delivery out, so no wait is long enough to tell a dead producer from a slow broker, and replacing "
                "the idempotent producer gives up its de-duplication; leave it unset (the producer is then replaced "
                "only on a fatal error), or set a message.timeout.ms"
            )
        if self.producer_stall_timeout_s <= delivery_timeout_s:
            raise ValueError(
                f"producer_stall_timeout_s ({self.producer_stall_timeout_s:g}) must exceed librdkafka's delivery "
                f"timeout (message.timeout.ms: {delivery_timeout_s:g} s): before it, a slow delivery is not a "
                "dead producer, and replacing the idempotent producer gives up its de-duplication"
            )
        return self

    @model_validator(mode="after")
    def _check_schema_registry(self) -> ServiceConfig:
        if self.value_format != "json" and self.schema_registry_url is None:
            raise ValueError(f"value_format {self.value_format} needs the Schema Registry: set schema_registry_url")
        if self.value_format != "json" and self.request_format == "oip":
            raise ValueError(f"request_format oip takes JSON requests; value_format is {self.value_format}")
        if "url" in self.schema_registry:
            raise ValueError("the Schema Registry's url is set by --schema-registry-url; remove it from "
                             "schema_registry")
        for key in _REGISTRY_NUMBERS & self.schema_registry.keys():
            if not re.fullmatch(r"\d+(\.\d*)?", self.schema_registry[key].get_secret_value()):
                raise ValueError(f"schema_registry {key} must be a number")
        return self

    @model_validator(mode="after")
    def _check_models(self) -> ServiceConfig:
        if not self.models:
            return self
        names = [spec.name for spec in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be distinct: {', '.join(names)}")
        given = sorted(set(_MODEL_FIELDS) & self.model_fields_set)
        if given:
            raise ValueError(f"with models, each model sets its own handler, model, handler_options, name and "
                             f"version: remove {', '.join(given)}")
        owner: dict[str, str] = {}
        for spec in self.models:
            for topic in spec.request_topics:
                if topic not in self.request_topics:
                    raise ValueError(f"model {spec.name}: its request topic {topic!r} is not one of request_topics "
                                     f"({', '.join(self.request_topics)})")
                if topic in owner:
                    raise ValueError(f"request topic {topic!r} is mapped to two models: {owner[topic]} and "
                                     f"{spec.name}")
                owner[topic] = spec.name
            try:  # the handler's own defaults come when the model is built: resolving a handler imports it
                self.for_model(spec)
            except ValidationError as exc:
                raise ValueError(f"model {spec.name}: {_problems(exc)}") from None
        return self

    def for_model(self, spec: ModelSpec, handler_defaults: Mapping[str, Any] | None = None) -> ServiceConfig:
        """The settings one model is served with: the service's, with the model's own fields in place. Its
        batching: the service's, then its handler's defaults for it (a TorchServe archive's), then its own."""
        own = spec.model_dump(include={"handler", "model", "handler_options"}, exclude_none=True)
        values = {name: getattr(self, name) for name in type(self).model_fields}
        batching = {**self.batching.model_dump(), **(handler_defaults or {}), **spec.batching}
        return ServiceConfig(**{**values, **own, "batching": batching, "model_name": spec.name,
                                "model_version": spec.version, "models": []})

    def model_configs(self) -> list[ServiceConfig]:
        """The settings of each served model, the default (first) one first: with no ``models``, this one. Each
        with its handler's batching defaults for its model in place (``Handler.batching_defaults``): over the
        service's batching for a ``models`` entry, under every batching option given for the one model."""
        if not self.models:
            defaults = _handler_defaults(self.handler, self.model, self.handler_options)
            return [self._under_given(defaults) if defaults else self]
        configs = []
        for spec in self.models:
            try:
                configs.append(self.for_model(spec, _handler_defaults(spec.handler, spec.model, spec.handler_options)))
            except (ValidationError, ConfigError) as exc:
                raise ConfigError(f"invalid configuration: model {spec.name}: {_problems(exc)}") from exc
        return configs

    def _under_given(self, defaults: Mapping[str, Any]) -> ServiceConfig:
        """This config with ``defaults`` for the batching fields that no flag, env var or YAML key set."""
        values = {name: getattr(self, name) for name in type(self).model_fields}
        try:
            return ServiceConfig(**{**values, "batching": {**defaults, **self.batching.model_dump(exclude_unset=True)}})
        except ValidationError as exc:
            raise ConfigError(describe_errors(exc)) from exc

    def model_topics(self) -> dict[str, str]:
        """Request topic -> the name of the model that serves its records."""
        return {topic: spec.name for spec in self.models for topic in spec.request_topics}

    def warnings(self) -> list[str]:
        """Settings that are allowed but trade something away, in words, for the log at start."""
        found = []
        if self.consumer_config().get("auto.offset.reset", "").lower() in ("latest", "largest", "end"):
            found.append("auto.offset.reset=latest: a partition without a committed offset (a new group, or offsets "
                         "expired or out of range after a lost group or a truncated log) starts at its end, and the "
                         "requests before it are never answered; the default earliest answers them")
        return found

    @property
    def dead_letter_max_bytes(self) -> int:
        """The largest record kinference writes for a request it accepts: the dead letter of a maximal request."""
        return self.max_request_bytes + self.max_header_bytes + self.max_key_bytes + _DEAD_LETTER_OVERHEAD

    def topic_partitions(self) -> dict[str, int]:
        """Each topic that ``kinference topics create`` makes, with its partition count."""
        return {**dict.fromkeys(self.request_topics, self.partitions),
                self.reply_topic: self.reply_partitions or self.partitions,
                self.dead_letter_topic: self.dead_letter_partitions}

    @property
    def resume_threshold(self) -> int:
        return self.max_in_flight // 2 if self.resume_in_flight is None else self.resume_in_flight

    @property
    def incremental_rebalancing(self) -> bool:
        """Whether the group protocol moves only the partitions that change owner."""
        consumer = self.consumer_config()
        return (consumer.get("group.protocol", "classic").lower() == "consumer"
                or "cooperative" in consumer.get("partition.assignment.strategy", ""))

    @property
    def delivery_timeout_ms(self) -> int:
        """librdkafka's own limit on delivering one record (``message.timeout.ms``, alias ``delivery.timeout.ms``)."""
        producer = self.producer_config()
        return int(producer.get("message.timeout.ms", producer.get("delivery.timeout.ms",
                                                                   _LIBRDKAFKA_DELIVERY_TIMEOUT_MS)))

    @property
    def stall_timeout_s(self) -> float:
        """How long no successful delivery, with records outstanding, means a dead producer: librdkafka's delivery
        timeout plus 30 s, so that a slow delivery is never mistaken for one; never (infinity) when that timeout is
        0, which librdkafka takes as no limit."""
        if self.producer_stall_timeout_s is not None:
            return self.producer_stall_timeout_s
        if self.delivery_timeout_ms == 0:
            return math.inf
        return self.delivery_timeout_ms / 1000 + 30.0

    def reply_topic_allowed(self, topic: str) -> bool:
        """Whether a request may have its reply written to ``topic``: the default reply topic, or a name or
        pattern of ``reply_topics_allowed``; never a request topic or the dead-letter topic (the service
        would feed itself, or forge dead letters), nor an internal topic (``INTERNAL_TOPICS``), whatever the
        patterns say."""
        if topic == self.reply_topic:
            return True
        if topic in self.request_topics or topic == self.dead_letter_topic or topic.startswith(INTERNAL_TOPICS):
            return False
        return any(fnmatch.fnmatchcase(topic, pattern) for pattern in self.reply_topics_allowed)

    def _passthrough(self, *maps: dict[str, SecretStr]) -> dict[str, str]:
        merged: dict[str, str] = {}
        for mapping in maps:
            merged.update({key: secret.get_secret_value() for key, secret in mapping.items()})
        return merged

    def topics(self) -> list[str]:
        """Every topic the service reads or writes by default: request, reply and dead-letter topics."""
        return [*self.request_topics, self.reply_topic, self.dead_letter_topic]

    def admin_config(self) -> dict[str, str]:
        """The pass-through properties common to every client (``kafka``: security, SASL), for an admin
        client."""
        return self._passthrough(self.kafka)

    def consumer_config(self) -> dict[str, str]:
        """The librdkafka consumer dict: kinference's defaults, then the user's pass-through properties."""
        given = self._passthrough(self.kafka, self.kafka_consumer)
        classic = given.get("group.protocol", "classic").lower() == "classic"
        return {
            "bootstrap.servers": self.bootstrap_servers,
            "group.id": self.group_id,
            **_CONSUMER_DEFAULTS,
            **(_CLASSIC_ASSIGNOR if classic else {}),
            **given,
        }

    def share_consumer_config(self) -> dict[str, str]:
        """The librdkafka share consumer dict (``group_type=share``): explicit acknowledgement, then the user's
        pass-through properties. The consumer group's defaults do not apply: a share consumer refuses them."""
        given = self._passthrough(self.kafka, self.kafka_consumer)
        given.pop("auto.offset.reset", None)  # a share group's start is a group config: share_auto_offset_reset
        return {
            "bootstrap.servers": self.bootstrap_servers,
            "group.id": self.group_id,
            "share.acknowledgement.mode": "explicit",
            "statistics.interval.ms": _CONSUMER_DEFAULTS["statistics.interval.ms"],
            **given,
        }

    @property
    def share_auto_offset_reset(self) -> str:
        """Where a new share group starts reading: the consumer's ``auto.offset.reset`` (kinference's default:
        earliest), which the service sets as the group's ``share.auto.offset.reset`` (Kafka's default: latest)."""
        return self.consumer_config()["auto.offset.reset"]

    def producer_config(self) -> dict[str, str]:
        """The librdkafka producer dict: kinference's defaults, then the user's pass-through properties."""
        return {
            "bootstrap.servers": self.bootstrap_servers,
            **_PRODUCER_DEFAULTS,
            **self._passthrough(self.kafka, self.kafka_producer),
        }

    def schema_registry_config(self) -> dict[str, Any]:
        """The SchemaRegistryClient dict: the URL, then the user's pass-through properties."""
        given: dict[str, Any] = self._passthrough(self.schema_registry)
        for key in _REGISTRY_NUMBERS & given.keys():
            given[key] = float(given[key]) if "." in given[key] else int(given[key])
        return {"url": self.schema_registry_url, **given}


def _options() -> dict[str, FieldInfo]:
    options: dict[str, FieldInfo] = {}
    for name, field in ServiceConfig.model_fields.items():
        options.update(Batching.model_fields if name == "batching" else {name: field})
    return options


OPTIONS = _options()
"""Every option by name, as flags, env vars, YAML keys and docs/configuration.md list them: ``ServiceConfig``'s
fields, with ``Batching``'s in place of ``batching``."""


def env_overrides(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``KINFERENCE_MAX_BATCH_SIZE=8`` -> ``{"max_batch_size": "8"}`` for every option."""
    environ = os.environ if environ is None else environ
    overrides = {}
    for name in OPTIONS:
        value = environ.get(ENV_PREFIX + name.upper())
        if value is not None:
            overrides[name] = value
    return overrides


def load_config(
    cli: Mapping[str, Any] | None = None,
    config_file: Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> ServiceConfig:
    """Merge default < YAML < env < CLI and validate; raise ``ConfigError`` with every problem listed.

    Key/value options merge key by key across the layers (``kafka`` from a YAML file plus
    ``KINFERENCE_KAFKA`` with the SASL password from a secret); every other option is replaced whole. The
    model's own settings (a TorchServe archive's batch size, delay, micro-batching), which go between the
    defaults and YAML, come in ``model_configs``, where the handler is resolved: resolving it imports it.
    """
    layers = [
        read_yaml(config_file) if config_file is not None else {},
        env_overrides(environ),
        {key: value for key, value in (cli or {}).items() if value is not None},
    ]
    values: dict[str, Any] = {}
    try:
        for layer in layers:
            for key, value in layer.items():
                if key in _MERGED and key in values:
                    values[key] = {**_key_values(values[key]), **_key_values(value)}
                else:
                    values[key] = value
        return ServiceConfig(**values)
    except ValidationError as exc:
        raise ConfigError(describe_errors(exc)) from exc
    except ValueError as exc:  # a malformed key=value item, found while merging
        raise ConfigError(f"invalid configuration: {exc}") from exc


HANG_MARGIN = 10.0
"""``--device-hang-s auto``: this many times the calibration's slowest device batch..."""
HANG_FLOOR_S = 30.0
"""...and never less than this, so a short calibration on a quiet device does not make a busy one look hung."""
ENGINE_HANG_S = 60.0
"""``--device-hang-s auto`` for a generative engine, which has no calibration: above a long prompt's prefill."""


def hang_limit(setting: float | str, slowest_batch_s: float | None = None) -> float:
    """``--device-hang-s`` in seconds: as set; or (``auto``) derived from the calibration's slowest batch, or, for a
    generative engine (``slowest_batch_s`` None), ``ENGINE_HANG_S``."""
    if setting != "auto":
        return float(setting)
    if slowest_batch_s is None:
        return ENGINE_HANG_S
    return max(HANG_FLOOR_S, HANG_MARGIN * slowest_batch_s)


def served_name(settings: ServiceConfig, handler: Handler) -> str:
    """A model's name (set up): in its metrics, its errors, OIP and the device process's calls. Here, where both the
    workers (``path.models``) and the device process (``accelerator.device_process``) read it."""
    return settings.model_name or handler.describe().get("model") or settings.handler


def _handler_defaults(handler: str, model: Path | None, options: Mapping[str, Any]) -> dict[str, Any]:
    """The batching settings the handler asks for ``model`` (a TorchServe archive's), as batching fields."""
    from kinference.handlers import handler_class

    resolved = handler_class(handler)  # a handler that cannot load says so as the service says it: HandlerLoadError
    try:
        return resolved.batching_defaults(model, options)
    except HandlerLoadError as exc:
        raise ConfigError(str(exc)) from exc


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of option: value")
    return {str(key).replace("-", "_"): value for key, value in data.items()}


def _option_loc(loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    """Where a problem is, as the user names it: batching fields are options of their own."""
    return loc[1:] if loc[:1] == ("batching",) else loc


def _problems(exc: Exception) -> str:
    if not isinstance(exc, ValidationError):
        return str(exc)
    return "; ".join(f"{'.'.join(map(str, _option_loc(error['loc']))) or 'config'}: {error['msg']}"
                     for error in exc.errors())


def describe_errors(exc: ValidationError) -> str:
    lines = ["invalid configuration:"]
    for error in exc.errors():
        loc = _option_loc(error["loc"])
        field = ".".join(str(part) for part in loc) or "config"
        where = f"{field} (--{str(loc[0]).replace('_', '-')}, {ENV_PREFIX}{str(loc[0]).upper()})" if loc else field
        lines.append(f"  {where}: {error['msg']}")
    return "\n".join(lines)
