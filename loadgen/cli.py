"""``kinference loadgen``: closed- or open-loop load, a concurrency sweep, a report, JSON and plots.

The flag names and JSON keys are public (docs/loadgen.md); do not rename them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console

from kinference.loadgen.client import Client
from kinference.loadgen.corpus import PROFILES, builtin_corpus, read_jsonl
from kinference.loadgen.errors import ClientError
from kinference.loadgen.live import ProgressView
from kinference.loadgen.plot import plot_run, plot_sweep
from kinference.loadgen.runner import LoadPlan, run_load, run_sweep
from kinference.loadgen.tables import run_table, sweep_table
from kinference.protocol import BOOTSTRAP_SERVERS_ENV, KAFKA_PROPERTIES_ENV, parse_properties


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kinference loadgen",
        description="Send requests to kinference through Kafka and measure replies.",
        epilog="Closed loop: --concurrency C. Open loop: --rate R. Sweep: --sweep-concurrency 1,4,16,64. "
               "A generative model (--handler generate): add --generative.",
    )
    kafka = parser.add_argument_group("Kafka")
    kafka.add_argument("--bootstrap-servers", default=os.environ.get(BOOTSTRAP_SERVERS_ENV, "127.0.0.1:9092"),
                       help=f"Kafka bootstrap servers (default: {BOOTSTRAP_SERVERS_ENV}, else 127.0.0.1:9092)")
    kafka.add_argument("--request-topic", default="kinference-requests")
    kafka.add_argument("--reply-topic", default="kinference-replies")
    kafka.add_argument("--reply-partition", type=int, help="reply partition to read (default: a random one)")
    kafka.add_argument("--kafka", action="append", default=[], metavar="KEY=VALUE",
                       help="librdkafka property for the client's producer and consumer (repeatable), over "
                       f"those of {KAFKA_PROPERTIES_ENV} (a JSON object or key=value pairs, as for serve)")
    load = parser.add_argument_group("load")
    load.add_argument("--concurrency", type=int, help="closed loop: requests in flight")
    load.add_argument("--rate", type=float, help="open loop: requests per second")
    load.add_argument("--arrivals", choices=("poisson", "constant"), default="poisson",
                      help="open loop inter-arrival times (default: poisson)")
    load.add_argument("--sweep-concurrency", type=concurrency_list, metavar="C1,C2,...",
                      help="one closed-loop run per concurrency, e.g. 1,4,16,64,256")
    load.add_argument("--requests", type=int, help="measured requests per run")
    load.add_argument("--duration", type=float, help="measured seconds per run (default: 10)")
    load.add_argument("--warmup", type=float, default=1.0, help="seconds of unmeasured load first (default: 1)")
    load.add_argument("--timeout", type=float,
                      help="seconds to wait for a reply before counting the request lost (default: 10; "
                           "--generative: 60)")
    load.add_argument("--payloads", type=Path,
                      help="JSON-lines file, one request value per line (default: built-in text corpus)")
    load.add_argument("--corpus", choices=sorted(PROFILES),
                      help="length mix of the built-in corpus: mixed (queries to long passages, the default) "
                           "or short (queries and sentences, the default of --generative)")
    generation = parser.add_argument_group("generative models")
    generation.add_argument("--generative", action="store_true",
                            help="stream each request (an OpenAI chat-completions body, or {\"prompt\": ...}) and "
                                 "measure tokens/s, time to first chunk and between chunks")
    generation.add_argument("--max-tokens", type=int, default=GENERATION_MAX_TOKENS,
                            help="--generative: max_tokens of each request that sets none "
                                 f"(default: {GENERATION_MAX_TOKENS})")
    load.add_argument("--seed", type=int, default=0, help="seed of the corpus and Poisson arrivals")
    output = parser.add_argument_group("output")
    output.add_argument("--out", type=Path, help="write the JSON report here")
    output.add_argument("--plot", type=Path, help="write a PNG plot here")
    output.add_argument("--label", default="kinference", help="name of this run's line in sweep plots")
    output.add_argument("--compare", type=Path, nargs="+", default=[], metavar="REPORT.json",
                        help="sweep reports (--out of earlier sweeps) drawn beside this one in --plot")
    output.add_argument("--no-progress", action="store_true", help="no live progress bar")
    return parser


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        plan = _plan(args)
        kafka = kafka_properties(args.kafka)
        payloads = read_jsonl(args.payloads) if args.payloads else builtin_corpus(
            args.corpus or ("short" if args.generative else "mixed"), seed=args.seed)
        if args.generative:
            payloads = generation_requests(payloads, args.max_tokens)
        elif not args.payloads:
            # The mixed corpus has paragraphs past MiniLM's 256 tokens, which the embedding handler refuses unless
            # asked to cut them (input_too_long): a load test of the built-in corpus asks, as the benchmarks do.
            payloads = [{**payload, "truncate": True} for payload in payloads]
        compare = [_read_sweep(path) for path in args.compare]
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    console = Console()
    client = Client(args.bootstrap_servers, args.request_topic, args.reply_topic,
                    reply_partition=args.reply_partition, timeout_s=plan.timeout_s, kafka=kafka)
    try:
        with client:
            execute(client, plan, payloads, console,
                    Reporting(label=args.label, progress=not args.no_progress, out=args.out, plot=args.plot,
                              compare=compare), sweep=args.sweep_concurrency)
    except ClientError as exc:
        console.print(f"[red]kinference loadgen: {exc}[/red]")
        return 1
    return 0


@dataclass(frozen=True)
class Reporting:
    """How a run is shown and kept: its label, live progress, and the files written (``out``: the JSON report)."""

    label: str = "kinference"
    progress: bool = True
    out: Path | None = None
    plot: Path | None = None
    compare: Sequence[tuple[str, list[dict[str, Any]]]] = ()
    """Other sweeps (label, runs) drawn beside this one on the plot."""


def execute(client: Client, plan: LoadPlan, payloads: Sequence[Any], console: Console, reporting: Reporting, *,
            sweep: Sequence[int] | None = None) -> dict[str, Any]:
    """Run the load (or the sweep), print the report, write ``reporting``'s ``out`` and ``plot``; return the
    report."""
    label, out, plot = reporting.label, reporting.out, reporting.plot
    header = {"label": label, "request_topic": client.request_topic, "reply_topic": client.reply_topic}
    with ProgressView(console, enabled=reporting.progress) as view:
        if sweep:
            results = asyncio.run(run_sweep(client, plan, sweep, payloads, view))
        else:
            results = [asyncio.run(run_load(client, plan, payloads, view, label))]
    if sweep:
        report: dict[str, Any] = {**header, "sweep_concurrency": list(sweep),
                                  "runs": [result.report() for result in results]}
        console.print(sweep_table(report["runs"]))
        if plot:
            plot_sweep([(label, report["runs"]), *reporting.compare], plot)
    else:
        report = {**header, **results[0].report()}
        console.print(run_table(report))
        if plot:
            plot_run(results[0].samples, plot, title=f"kinference loadgen: {label}")
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    for name, path in (("report", out), ("plot", plot)):
        if path:
            console.print(f"{name}: {path}")
    return report


def kafka_properties(items: Sequence[str], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``KINFERENCE_KAFKA`` (as serve reads it), then each ``--kafka KEY=VALUE`` over it."""
    variables = os.environ if environ is None else environ
    try:
        properties = parse_properties(variables.get(KAFKA_PROPERTIES_ENV, ""))
    except ValueError as exc:
        raise ValueError(f"{KAFKA_PROPERTIES_ENV}: {exc}") from None
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError("--kafka takes KEY=VALUE")
        properties[key.strip()] = value.strip()
    return properties


def _plan(args: argparse.Namespace) -> LoadPlan:
    if args.sweep_concurrency and (args.concurrency or args.rate):
        raise ValueError("--sweep-concurrency replaces --concurrency and --rate")
    if args.compare and not args.sweep_concurrency:
        raise ValueError("--compare draws sweeps: use it with --sweep-concurrency")
    concurrency = args.sweep_concurrency[0] if args.sweep_concurrency else args.concurrency
    if concurrency is None and args.rate is None:
        concurrency = 1
    timeout = args.timeout if args.timeout is not None else 60.0 if args.generative else 10.0
    return LoadPlan(concurrency=concurrency, rate=args.rate, arrivals=args.arrivals, requests=args.requests,
                    duration_s=args.duration, warmup_s=args.warmup, timeout_s=timeout, seed=args.seed,
                    generative=args.generative)


GENERATION_MAX_TOKENS = 64


def generation_requests(payloads: Sequence[Any], max_tokens: int) -> list[dict[str, Any]]:
    """The generation requests of ``--generative``: the built-in corpus's ``{"text": ...}`` become prompts, and every
    body without ``max_tokens`` (or ``max_completion_tokens``) gets ``max_tokens``. ValueError for a payload that is
    not a JSON object (a streamed request is one)."""
    if max_tokens < 1:
        raise ValueError(f"--max-tokens must be at least 1, got {max_tokens}")
    requests = []
    for index, payload in enumerate(payloads):
        if not isinstance(payload, dict):
            raise ValueError(f"--generative sends JSON objects (chat-completions bodies); payload {index} is "
                             f"{type(payload).__name__}")
        body = {"prompt": payload["text"]} if payload.keys() == {"text"} else payload
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body = {**body, "max_tokens": max_tokens}
        requests.append(body)
    return requests


def concurrency_list(text: str) -> list[int]:
    try:
        values = [int(item) for item in text.split(",") if item.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected integers like 1,4,16: {text!r}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,4,16: {text!r}")
    return values


def _read_sweep(path: Path) -> tuple[str, list[dict[str, Any]]]:
    report = orjson.loads(path.read_bytes())
    if not isinstance(report, dict) or "runs" not in report:
        raise ValueError(f"{path} is not a sweep report (no 'runs')")
    return str(report.get("label") or path.stem), report["runs"]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
