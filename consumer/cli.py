"""``kinference`` command line: ``serve``, ``broker``, ``loadgen``, ``demo`` and ``bench``.

``serve`` has one flag per ``ServiceConfig`` field, generated from the model so flags, env vars,
YAML keys and docs never drift apart: ``--max-batch-size`` <-> ``KINFERENCE_MAX_BATCH_SIZE`` <->
``max_batch_size:``.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import types
import typing
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from kinference.consumer.config import ENV_PREFIX, ServiceConfig, load_config
from kinference.consumer.errors import KinferenceError
from kinference.consumer.logs import setup_logging

log = logging.getLogger("kinference")

_HEALTH_CHECK_S = 1.0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # loadgen and demo own their flags; hand them the rest of the command line untouched.
    if argv and argv[0] == "loadgen":
        from kinference.loadgen.cli import main as loadgen_main

        return loadgen_main(argv[1:])
    if argv and argv[0] == "demo":
        from kinference.loadgen.demo import main as demo_main

        return demo_main(argv[1:])
    if argv and argv[0] == "bench":
        from kinference.loadgen.bench import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
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
    serve.set_defaults(run=run_serve)

    broker = commands.add_parser("broker", help="run the embedded Tansu broker for local development")
    broker.add_argument("--host", default="127.0.0.1", help="listen address (default: %(default)s)")
    broker.add_argument("--port", type=int, default=9092, help="listen port (default: %(default)s)")
    broker.add_argument("--storage", help="Tansu storage engine URL (default: memory, lost on exit)")
    broker.set_defaults(run=run_broker)

    commands.add_parser("loadgen", help="drive load at a running service and report (see kinference loadgen -h)",
                        add_help=False)
    commands.add_parser("demo", help="broker + service + bundled model + load sweep, one command",
                        add_help=False)
    commands.add_parser("bench", help="every scenario side by side on one embedded broker (see kinference bench -h)",
                        add_help=False)
    return parser


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per config field; values stay strings here and are validated by ``ServiceConfig``."""
    for name, field in ServiceConfig.model_fields.items():
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


def _config_from_args(args: argparse.Namespace) -> ServiceConfig:
    cli = {name: getattr(args, name) for name in ServiceConfig.model_fields}
    return load_config(cli, args.config)


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()

    def handle(signum: int, _frame: Any) -> None:
        log.info("received %s; stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
    return stop


def run_serve(args: argparse.Namespace) -> int:
    from kinference.consumer.broker import EmbeddedBroker, create_topics
    from kinference.consumer.service import Service

    config = _config_from_args(args)
    setup_logging(config.log_level, config.log_format)
    stop = _stop_on_signals()
    with ExitStack() as stack:
        if config.embedded_broker:
            broker = stack.enter_context(EmbeddedBroker())
            topics = [*config.request_topics, config.reply_topic, config.dead_letter_topic]
            create_topics(broker.bootstrap_servers, dict.fromkeys(topics, 4))
            config = config.model_copy(update={"bootstrap_servers": broker.bootstrap_servers})
            log.info("embedded broker: --bootstrap-servers %s", broker.bootstrap_servers)
        service = Service(config)
        service.start()
        try:
            while not stop.wait(_HEALTH_CHECK_S):
                if not service.healthy:
                    log.critical("a service thread died; stopping (exit code 1)")
                    return 1
        finally:
            service.stop()
    return 0


def run_broker(args: argparse.Namespace) -> int:
    from kinference.consumer.broker import EmbeddedBroker

    setup_logging("INFO")
    stop = _stop_on_signals()
    with EmbeddedBroker(port=args.port, host=args.host, storage=args.storage) as broker:
        print(f"broker ready: --bootstrap-servers {broker.bootstrap_servers} (Ctrl-C to stop)", flush=True)
        stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
