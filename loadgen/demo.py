"""``kinference demo``: broker, topics, service with the bundled MiniLM model, a short concurrency sweep,
report, plot and JSON, and a clean shutdown, all in this one process (about 35 s on 2 cores)."""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from rich.console import Console

from kinference.consumer.brokers.broker import LOW_LATENCY_CONSUMER, EmbeddedBroker
from kinference.consumer.config import Batching, ServiceConfig
from kinference.consumer.ops.topics import create_topics
from kinference.consumer.service import Service
from kinference.errors import KinferenceError
from kinference.loadgen.cli import Reporting, concurrency_list, execute
from kinference.loadgen.client import Client
from kinference.loadgen.corpus import PROFILES, builtin_corpus
from kinference.loadgen.runner import LoadPlan

_TOPICS = {"kinference-requests": 4, "kinference-replies": 4, "kinference-dead-letters": 1}
# Tansu holds a group join for about session.timeout.ms / 2: a short session keeps start-up quick.
# A quick join on the embedded broker (Tansu holds a join for ~session.timeout.ms / 2), and its low-latency fetch.
_DEMO_CONSUMER = {"session.timeout.ms": "6000", "heartbeat.interval.ms": "2000", **LOW_LATENCY_CONSUMER}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kinference demo",
        description="Start the embedded broker and the service with the bundled MiniLM embedding model, run a "
                    "short concurrency sweep, print the report, write JSON and a plot, shut down.",
    )
    parser.add_argument("--output-dir", type=Path, default=Path("kinference-demo-output"),
                        help="where the report, plot and logs go (default: %(default)s)")
    parser.add_argument("--handler", default="embedding", help="handler to serve (default: %(default)s)")
    parser.add_argument("--model", type=Path, help="local model directory (default: the bundled MiniLM)")
    parser.add_argument("--max-batch-size", type=int, default=32, help="(default: %(default)s)")
    parser.add_argument("--sweep-concurrency", type=concurrency_list, default=[1, 4, 16, 64],
                        metavar="C1,C2,...", help="(default: 1,4,16,64)")
    parser.add_argument("--duration", type=float, default=4.0, help="measured seconds per step (default: 4)")
    parser.add_argument("--warmup", type=float, default=1.0, help="warm-up seconds per step (default: 1)")
    parser.add_argument("--corpus", choices=sorted(PROFILES), default="short",
                        help="built-in corpus length mix (default: %(default)s, online query embedding)")
    parser.add_argument("--no-progress", action="store_true", help="no live progress bar")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    output_dir = args.output_dir.resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(filename=output_dir / "kinference-demo.log", level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    console = Console()
    began = time.monotonic()
    try:
        _run(args, output_dir, console, began)
    except (KinferenceError, ValueError) as exc:  # ValueError: pydantic's ValidationError of a bad flag
        console.print(f"[red]kinference demo failed: {exc}[/red] (log: {output_dir / 'kinference-demo.log'})")
        return 1
    console.print(f"[bold green]demo finished in {time.monotonic() - began:.0f} s.[/bold green] "
                  f"Files in {output_dir}: sweep.json (report), sweep.png (plot), kinference-demo.log, broker.log")
    return 0


def _run(args: argparse.Namespace, output_dir: Path, console: Console, began: float) -> None:
    def step(text: str) -> None:
        console.print(f"[dim]{time.monotonic() - began:5.1f} s[/dim]  {text}")

    step("starting the embedded Kafka broker (Tansu)")
    with EmbeddedBroker(log_file=output_dir / "broker.log") as broker:
        create_topics(broker.bootstrap_servers, _TOPICS)
        step(f"broker on {broker.bootstrap_servers}; topics {', '.join(_TOPICS)}")
        config = ServiceConfig(
            bootstrap_servers=broker.bootstrap_servers, request_topics=["kinference-requests"],
            reply_topic="kinference-replies", dead_letter_topic="kinference-dead-letters", group_id="kinference-demo",
            handler=args.handler, model=args.model, batching=Batching(max_batch_size=args.max_batch_size),
            kafka_consumer=_DEMO_CONSUMER,
            # Loopback and any free port: the demo must not clash with a service already on 9400.
            metrics_host="127.0.0.1", metrics=True, metrics_port=0,
        )
        step(f"loading the {args.handler} handler and starting the service")
        with Service(config) as service:
            if not service.wait_ready(60):
                raise KinferenceError("the service got no partitions within 60 s")
            step(f"service ready: {service.handler.describe()}")
            sweep = args.sweep_concurrency
            plan = LoadPlan(concurrency=sweep[0], duration_s=args.duration, warmup_s=args.warmup)
            label = f"{args.handler}, max batch {args.max_batch_size}, {args.corpus} texts"
            with Client(broker.bootstrap_servers, "kinference-requests", "kinference-replies",
                        timeout_s=plan.timeout_s, reply_consumer=LOW_LATENCY_CONSUMER) as client:
                step(f"sweeping concurrency {sweep}: {args.warmup:g} s warm-up + {args.duration:g} s each")
                execute(client, plan, builtin_corpus(args.corpus), console,
                        Reporting(label=label, progress=not args.no_progress, out=output_dir / "sweep.json",
                                  plot=output_dir / "sweep.png"), sweep=sweep)
            step("stopping the service and the broker")
