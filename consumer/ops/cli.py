"""The service's commands: ``kinference serve``, ``topics``, ``healthcheck`` and ``broker``.

``serve`` has one flag per option (``config.OPTIONS``: ``ServiceConfig``'s fields, the batching ones each on
its own), generated from the model so flags, env vars, YAML keys and docs never drift apart:
``--max-batch-size`` <-> ``KINFERENCE_MAX_BATCH_SIZE`` <-> ``max_batch_size:``. ``topics create`` reads the
same settings, so it creates exactly the topics that ``serve`` will use, with the same Kafka properties (SASL
included). ``kinference.cli`` dispatches here.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import types
import typing
import urllib.error
import urllib.request
from collections.abc import Iterable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from kinference.consumer.config import ENV_PREFIX, OPTIONS, ServiceConfig, load_config
from kinference.consumer.ops.logs import setup_logging
from kinference.errors import KinferenceError

log = logging.getLogger("kinference")

_HEALTH_CHECK_S = 1.0
LOCAL_BROKER_PORT = 19092
"""``kinference broker``'s port: not Kafka's 9092, which a local Kafka of the user's may hold."""
_TOPICS_FIELDS = frozenset({"bootstrap_servers", "request_topics", "reply_topic", "dead_letter_topic", "kafka",
                            "partitions", "reply_partitions", "dead_letter_partitions", "replication_factor",
                            "topic_config", "max_request_bytes", "max_header_bytes", "max_key_bytes",
                            "kafka_producer"})
"""What ``topics create`` reads; every other serve flag is accepted there and ignored."""


def main(argv: list[str]) -> int:
    """``argv`` starts with the command name (``serve``, ``topics``, ``healthcheck`` or ``broker``)."""
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        code: int = args.run(args)
        return code
    except KinferenceError as exc:
        print(f"kinference: {exc}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kinference", description="Kafka-native streaming inference.")
    commands = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="run the inference service",
                                description="Run the service. Every flag also reads from "
                                f"{ENV_PREFIX}<FLAG_NAME> and from the --config YAML file.")
    serve.add_argument("--config", type=Path, help="YAML file of option: value (keys as the flag names)")
    add_config_flags(serve)
    # Internal: a worker of --workers N (or a device process) reports its health to its supervisor in this file.
    serve.add_argument("--worker-report", type=Path, help=argparse.SUPPRESS)
    # Internal: this process is device process I of its supervisor; a worker's device process listens here.
    serve.add_argument("--device-index", type=int, help=argparse.SUPPRESS)
    serve.add_argument("--device-socket", type=Path, help=argparse.SUPPRESS)
    serve.set_defaults(run=run_serve)

    topics = commands.add_parser(
        "topics", help="create the service's topics",
        description="Create the request, reply and dead-letter topics that `kinference serve` with the same "
        f"settings uses: it reads the same flags, {ENV_PREFIX}* env vars and --config file as serve, and takes "
        "every serve flag, so a serve command line works here (the flags that do not concern topics are "
        "ignored, with a note). The Kafka properties (--kafka, e.g. SASL) go to the admin client. Existing "
        "topics are left as they are; those whose partitions or configs differ from what was asked are "
        "reported.")
    topics.add_argument("action", choices=["create"])
    topics.add_argument("--config", type=Path, help="YAML file of option: value (as for serve)")
    add_config_flags(topics)
    topics.set_defaults(run=run_topics)

    health = commands.add_parser(
        "healthcheck", help="probe /healthz (or /readyz) of a running serve; exit 0 when it answers 200",
        description="GET /healthz of a running `kinference serve` and exit 0 if it answers 200. Without --url, "
        "the address comes from that process's own flags, environment and --config (read from /proc), so "
        "the container health check follows whatever port the service was given.")
    health.add_argument("--url", help="the /healthz URL (default: derived from the serve process)")
    health.add_argument("--pid", type=int, default=1, help="the serve process (default: %(default)s, the "
                        "container's main process)")
    health.add_argument("--timeout", type=float, default=4.0, help="seconds (default: %(default)s)")
    health.add_argument("--ready", action="store_true", help="probe /readyz instead (serving: model warmed, in the "
                        "group), on the same derived address: compose's readiness check")
    health.set_defaults(run=run_healthcheck)

    broker = commands.add_parser("broker", help="run the embedded Tansu broker for local development")
    broker.add_argument("--host", default="127.0.0.1", help="listen address (default: %(default)s)")
    broker.add_argument("--port", type=int, default=LOCAL_BROKER_PORT, help="listen port (default: %(default)s, "
                        "beside a local Kafka's 9092)")
    broker.add_argument("--storage", help="Tansu storage engine URL (default: memory, lost on exit)")
    broker.set_defaults(run=run_broker)
    return parser


def add_config_flags(parser: argparse.ArgumentParser, fields: Iterable[str] | None = None) -> None:
    """One flag per option (or per one of ``fields``); values stay strings here and are validated by
    ``ServiceConfig``."""
    for name in OPTIONS if fields is None else fields:
        field = OPTIONS[name]
        flag = "--" + name.replace("_", "-")
        default = field.default.model_dump() if hasattr(field.default, "model_dump") else field.default
        help_text = f"{field.description} Default: {default!r}. Env: {ENV_PREFIX}{name.upper()}."
        if _is_bool(field.annotation):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif _is_dict(field.annotation):
            parser.add_argument(flag, action="append", metavar="KEY=VALUE", default=None,
                                help=help_text + " Repeatable.")
        else:
            parser.add_argument(flag, default=None, metavar=name.upper(), help=help_text)


def _is_bool(annotation: Any) -> bool:
    return annotation is bool


def _is_dict(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    return origin is dict or (origin in (typing.Union, types.UnionType)
                               and any(typing.get_origin(arg) is dict for arg in typing.get_args(annotation)))


def _config_from_args(args: argparse.Namespace, environ: dict[str, str] | None = None,
                      cwd: Path | None = None) -> ServiceConfig:
    cli = {name: getattr(args, name) for name in OPTIONS if hasattr(args, name)}
    config_file = args.config if args.config is None or cwd is None else cwd / args.config
    return load_config(cli, config_file, environ)


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()

    def handle(signum: int, _frame: Any) -> None:
        log.info("received %s; stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
    return stop


def run_serve(args: argparse.Namespace) -> int:
    """Exit 0 after a clean stop (SIGTERM, SIGINT); 1 when the service cannot go on (a thread died, a fatal
    consumer or producer error, the broker away past the delivery retry timeout), so that the orchestrator
    restarts it. No record ends it (``publisher``: an unanswerable request is counted and committed past)."""
    from kinference.consumer.ops.supervisor import WorkerReport, die_with_supervisor, worker_hang_limit
    from kinference.consumer.service import Service, settle_heap

    config = _config_from_args(args)
    setup_logging(config.log_level, config.log_format)
    if args.worker_report is not None:
        die_with_supervisor()  # an orphan would go on serving beside a restarted supervisor's processes
    if args.device_index is not None:
        return _run_device(args, config)
    if args.worker_report is None:  # not supervised: this process may be the supervisor
        plan = plan_processes(config)
        if plan.devices or plan.workers != 1:
            return _run_workers(args, config, plan)
    stop = _stop_on_signals()
    with ExitStack() as stack:
        if config.embedded_broker:
            config = _with_embedded_broker(stack, config)
        # A worker's report lies in its supervisor's directory, which the host's workers share.
        service = Service(config, host_dir=args.worker_report.parent if args.worker_report is not None else None,
                          device_socket=args.device_socket)
        if args.worker_report is not None:
            progress = worker_hang_limit(config.device_hang_s)
            stack.enter_context(WorkerReport(args.worker_report, service, progress=lambda: progress))
        service.start()
        settle_heap()
        try:
            while not stop.wait(_HEALTH_CHECK_S):
                if service.failed:
                    log.critical("stopping (exit code 1): %s", "; ".join(service.problems()))
                    return 1
        finally:
            service.stop()
    return 0


@dataclass(frozen=True)
class Plan:
    """The processes of one ``kinference serve``: device processes (0: none) and workers (None: sized by the device
    processes' calibration)."""

    devices: int
    workers: int | None


def plan_processes(config: ServiceConfig) -> Plan:
    """``--device-process`` and ``--workers`` resolved on this host: a device process per GPU when the device is
    CUDA (``auto``), or when asked (``on``; on the CPU, one), for the models that can run in one."""
    from kinference.consumer.service import resolve_device
    from kinference.handlers import handler_class

    capable = [settings.handler for settings in config.model_configs()
               if handler_class(settings.handler).device_process]
    device = resolve_device(config.device)
    wanted = config.device_process == "on" or (config.device_process == "auto" and device.startswith("cuda"))
    if config.device_process == "on" and not capable:
        raise KinferenceError(f"--device-process on: no model's handler can run in a device process "
                              f"({', '.join(s.handler for s in config.model_configs())}); use --device-process off")
    devices = 0
    if wanted and capable:
        import torch

        devices = torch.cuda.device_count() if device == "cuda" else 1  # cuda:N, or the CPU: one
    if config.workers != "auto":
        return Plan(devices, config.workers)
    return Plan(devices, None if devices else 1)


def _run_device(args: argparse.Namespace, config: ServiceConfig) -> int:
    """A device process of the supervisor's (``device_process``): exit 0 after a clean stop, 1 when a thread of it
    died."""
    from kinference.consumer.accelerator.device_process import DeviceProcess
    from kinference.consumer.ops.supervisor import WorkerReport
    from kinference.consumer.service import resolve_device, settle_heap

    stop = _stop_on_signals()
    device = DeviceProcess(config, args.device_index, args.worker_report.parent, resolve_device(config.device))
    with WorkerReport(args.worker_report, device, progress=device.progress) as report:
        device.start(on_hung=report.wake)
        settle_heap()
        try:
            while not stop.wait(_HEALTH_CHECK_S):
                if device.failed:
                    log.critical("device process stopping (exit code 1): %s", "; ".join(device.problems()))
                    return 1
        finally:
            device.stop(config.shutdown_grace_s)
    return 0


def _with_embedded_broker(stack: ExitStack, config: ServiceConfig) -> ServiceConfig:
    """Start the embedded broker (stopped with ``stack``) and its topics; the config pointed at it."""
    from kinference.consumer.brokers.broker import LOW_LATENCY_CONSUMER, EmbeddedBroker
    from kinference.consumer.ops.topics import create_topics

    broker = stack.enter_context(EmbeddedBroker())
    create_topics(broker.bootstrap_servers, config.topic_partitions(), topic_config=config.topic_config)
    tuned = {key: SecretStr(value) for key, value in LOW_LATENCY_CONSUMER.items()}
    log.info("embedded broker: --bootstrap-servers %s", broker.bootstrap_servers)
    return config.model_copy(update={"bootstrap_servers": broker.bootstrap_servers,
                                      "embedded_broker": False,
                                      "kafka_consumer": {**tuned, **config.kafka_consumer}})


def _run_workers(args: argparse.Namespace, config: ServiceConfig, plan: Plan) -> int:
    """The supervisor (``supervisor``), its device processes, and its workers, each ``serve`` with the same flags and
    ``--workers 1``. Exit 0 after a clean stop, 1 when a process kept dying."""
    from prometheus_client import CollectorRegistry

    from kinference.consumer.ops.endpoints import Endpoints, EndpointSettings
    from kinference.consumer.ops.supervisor import Member, Supervisor, member_argv

    # Each model's settings with its handler's own (a TorchServe archive's), checked here: a bad one fails once,
    # with exit code 2, instead of in every worker until the supervisor gives up.
    config.model_configs()
    with ExitStack() as stack:
        overrides = ["--no-metrics"]
        if config.embedded_broker:  # one broker for the host, started here
            from kinference.consumer.brokers.broker import LOW_LATENCY_CONSUMER

            tuned = [item for key, value in LOW_LATENCY_CONSUMER.items() if key not in config.kafka_consumer
                     for item in ("--kafka-consumer", f"{key}={value}")]
            config = _with_embedded_broker(stack, config)
            overrides += ["--no-embedded-broker", "--bootstrap-servers", config.bootstrap_servers, *tuned]
        serve_argv = args.argv[args.argv.index("serve") + 1:]
        serve = [sys.executable, "-m", "kinference", "serve", *serve_argv, *overrides]
        given_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")

        def command(member: Member) -> list[str]:
            return member_argv(member, serve, plan.devices, supervisor.host_dir)

        supervisor = Supervisor(plan.workers, command, grace_s=config.shutdown_grace_s, devices=plan.devices,
                                metrics_dir=Path(given_dir) if given_dir else None)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda received, _frame: supervisor.stop(received))
        if config.metrics:
            registry = CollectorRegistry(auto_describe=False)
            registry.register(supervisor)
            endpoints = Endpoints(EndpointSettings.of(config), registry, supervisor.health_checks,
                                  supervisor.readiness_checks, supervisor.problems).start()
            stack.callback(endpoints.close)
        log.info("supervising %s workers and %d device processes",
                 "auto" if plan.workers is None else plan.workers, plan.devices)
        return supervisor.run()


def run_topics(args: argparse.Namespace) -> int:
    """Exit 0 when every topic exists afterwards (existing ones that differ from what was asked are reported,
    not changed), 1 when one needs a larger max.message.bytes than the broker's default and none is asked."""
    from kinference.consumer.ops.topics import KAFKA_MESSAGE_MAX_BYTES, create_topics, differences

    config = _config_from_args(args)
    ignored = sorted(name for name in OPTIONS
                     if getattr(args, name, None) is not None and name not in _TOPICS_FIELDS)
    if ignored:
        print("note: ignored by topics create: " + ", ".join("--" + name.replace("_", "-") for name in ignored),
              file=sys.stderr)
    if config.embedded_broker:
        raise KinferenceError("topics create makes topics on --bootstrap-servers; --embedded-broker makes its own")
    if "max.message.bytes" not in config.topic_config and config.dead_letter_max_bytes > KAFKA_MESSAGE_MAX_BYTES:
        print(f"kinference: the dead letter of a maximal request takes {config.dead_letter_max_bytes} bytes, more "
              f"than Kafka's default max.message.bytes ({KAFKA_MESSAGE_MAX_BYTES}): add --topic-config "
              f"max.message.bytes={config.dead_letter_max_bytes}", file=sys.stderr)
        return 1
    partitions = config.topic_partitions()
    created = create_topics(config.bootstrap_servers, partitions, replication_factor=config.replication_factor,
                            topic_config=config.topic_config, admin_config=config.admin_config())
    existing = {topic: count for topic, count in partitions.items() if topic not in created}
    differ = differences(config.bootstrap_servers, existing, config.topic_config, admin_config=config.admin_config()) \
        if existing else {}
    for topic, count in partitions.items():
        if topic in created:
            print(f"{topic}: created, {count} partitions")
        elif topic in differ:
            print(f"{topic}: exists and differs (left as it is): {'; '.join(differ[topic])}")
        else:
            print(f"{topic}: exists")
    return 0


def run_healthcheck(args: argparse.Namespace) -> int:
    url = args.url or f"{_endpoints_of(args.pid)}/{'readyz' if args.ready else 'healthz'}"
    try:
        with urllib.request.urlopen(url, timeout=args.timeout) as response:
            print(response.read().decode().strip())
            return 0
    except urllib.error.HTTPError as exc:
        print(f"{url}: {exc.code} {exc.read().decode().strip()}", file=sys.stderr)
    except (urllib.error.URLError, OSError) as exc:
        print(f"{url}: {exc}", file=sys.stderr)
    return 1


def _endpoints_of(pid: int) -> str:
    """Where the ``kinference serve`` running as ``pid`` serves /healthz and /readyz (``http://host:port``): its
    flags, environment and config file, merged as ``serve`` merges them."""
    proc = Path(f"/proc/{pid}")
    try:
        argv = [arg.decode() for arg in (proc / "cmdline").read_bytes().split(b"\0") if arg]
        environ = dict(item.decode().split("=", 1) for item in (proc / "environ").read_bytes().split(b"\0")
                       if b"=" in item)
        cwd = (proc / "cwd").resolve()
    except OSError as exc:
        raise KinferenceError(f"cannot read process {pid} ({exc}); pass --url") from exc
    if "serve" not in argv:
        raise KinferenceError(f"process {pid} is not kinference serve ({' '.join(argv)[:200]}); pass --url "
                              "or --pid")
    serve_args = build_parser().parse_args(argv[argv.index("serve"):])
    config = _config_from_args(serve_args, environ, cwd)
    if not config.metrics:
        raise KinferenceError(f"process {pid} serves no /healthz (metrics are off)")
    host = "127.0.0.1" if config.metrics_host in ("0.0.0.0", "", "::") else config.metrics_host
    return f"http://{host}:{config.metrics_port}"


def run_broker(args: argparse.Namespace) -> int:
    from kinference.consumer.brokers.broker import LOW_LATENCY_CONSUMER, EmbeddedBroker

    setup_logging("INFO")
    stop = _stop_on_signals()
    with EmbeddedBroker(port=args.port, host=args.host, storage=args.storage) as broker:
        low_latency = " ".join(f"--kafka-consumer {key}={value}" for key, value in LOW_LATENCY_CONSUMER.items())
        print(f"broker ready: --bootstrap-servers {broker.bootstrap_servers} (Ctrl-C to stop); consumers of this "
              f"broker want {low_latency}", flush=True)
        stop.wait()
    return 0
