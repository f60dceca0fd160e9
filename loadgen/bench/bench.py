"""``kinference bench``: every contender in one run, on the same local broker, model and corpus.

The scenarios (``SCENARIOS``; docs/benchmarks.md says what each one is):

- ceilings: the handler alone in this process (``inproc-fifo``, ``inproc-grouped``: texts batched in
  corpus order or sorted by length, at the best of a few batch sizes), and the plain consume ->
  produce ``relay`` (transport ceiling, echo payloads) beside kinference's echo handler (``kinference-echo``);
- baselines written the way users write them (``loadgen.bench.baselines``): ``per-message``,
  ``torchserve-b8`` and ``torchserve-b32`` (static batching, 50 ms delay, stages one after another);
- kinference settings: data in ``KINFERENCE_SETTINGS``, a name plus ``ServiceConfig`` overrides; the one that
  matches ``kinference serve``'s defaults (``default_setting()``) is the one the targets judge.

Each Kafka scenario gets its own topics and consumer group, runs in a child process of its own
(``contender``: it must not share this process's GIL with the load generator's client), and is measured
by the load generator (``loadgen.runner``) in closed loop at each concurrency, on each corpus. The
in-process ceilings run in this process, with nothing else running. Throughput in the tables is
``steady_rps``: requests completed per second *inside* the measured window (in a closed loop every
measured send follows a completion in the window, so it is ``sent / duration``); the load
generator's own ``throughput_rps``, which the final drain lowers, stays in each run's report.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import logging
import math
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import ValidationError
from rich.console import Console

from kinference.consumer.brokers.broker import BROKER_KINDS, LOW_LATENCY_CONSUMER, local_broker
from kinference.consumer.config import Batching, ServiceConfig
from kinference.consumer.ops.topics import create_topics
from kinference.consumer.service import resolve_device
from kinference.handlers import HandlerContext, load_handler
from kinference.loadgen.bench.baselines import (
    STATIC_DELAY_MS,
    LoopThread,
    MiniLM,
    PerMessageLoop,
    Relay,
    StaticBatchLoop,
    embedding_answers,
)
from kinference.loadgen.bench.ceiling import CUT, measure_ceiling
from kinference.loadgen.bench.command import measured, parse_options
from kinference.loadgen.bench.contender import Serve, contender
from kinference.loadgen.bench.machine import loadavg, machine
from kinference.loadgen.bench.outputs import Titled, add_report_arguments, print_tables, tables_markdown, write_reports
from kinference.loadgen.bench.serve import serve_kinference, serve_loop
from kinference.loadgen.cli import concurrency_list
from kinference.loadgen.client import Client
from kinference.loadgen.corpus import PROFILES, builtin_corpus
from kinference.loadgen.live import ProgressView
from kinference.loadgen.plot import plot_sweep
from kinference.loadgen.runner import LoadPlan, RunResult, run_sweep

log = logging.getLogger(__name__)

Kind = Literal["ceiling", "transport", "baseline", "kinference"]


@dataclass(frozen=True)
class KinferenceSetting:
    """One kinference configuration to measure: a name and the ``ServiceConfig`` fields it changes."""

    name: str
    overrides: dict[str, Any]
    about: str


_TOKEN_BUDGET = Batching.model_fields["max_batch_tokens"].default
# Every setting spells out its policy and token budget, so that the one matching kinference's defaults is found
# by comparing these fields (default_setting), not by a name that could go stale when a default changes.
KINFERENCE_SETTINGS: tuple[KinferenceSetting, ...] = (
    KinferenceSetting("kinference-greedy", {"batch_policy": "greedy", "max_batch_tokens": None},
                  "greedy batching, no token budget: FIFO batches bounded by count"),
    KinferenceSetting("kinference-greedy-tokens", {"batch_policy": "greedy", "max_batch_tokens": _TOKEN_BUDGET},
                  f"greedy batching within a budget of {_TOKEN_BUDGET} padded tokens, requests grouped by length"),
    KinferenceSetting("kinference-adaptive", {"batch_policy": "adaptive", "max_batch_tokens": None},
                  "adaptive batching (waits only where its cost model says it pays), no token budget"),
    KinferenceSetting("kinference-adaptive-tokens", {"batch_policy": "adaptive", "max_batch_tokens": _TOKEN_BUDGET},
                  f"adaptive batching within a budget of {_TOKEN_BUDGET} padded tokens"),
    KinferenceSetting("kinference-static", {"batch_policy": "static", "max_batch_delay_ms": STATIC_DELAY_MS,
                                    "max_batch_tokens": None},
                  f"static policy (TorchServe semantics, {STATIC_DELAY_MS:g} ms), no token budget, "
                  "kinference's stages"),
)
# What tells kinference settings apart: a setting is kinference's default when these equal ServiceConfig()'s.
_BATCHING_FIELDS = ("batch_policy", "max_batch_tokens", "max_batch_size", "max_batch_delay_ms", "target_latency_ms")


def default_setting(settings: Sequence[KinferenceSetting] = KINFERENCE_SETTINGS) -> str:
    """The name of the setting ``kinference serve`` runs with no options, which the targets judge: the one
    whose batching fields equal ``ServiceConfig``'s defaults. ValueError unless exactly one does, or if
    a setting is not a valid ``ServiceConfig``."""
    defaults = ServiceConfig().batching
    matches = []
    for setting in settings:
        try:
            batching = ServiceConfig(**setting.overrides).batching
        except ValidationError as exc:
            raise ValueError(f"kinference setting {setting.name}: {exc}") from exc
        if all(getattr(batching, name) == getattr(defaults, name) for name in _BATCHING_FIELDS):
            matches.append(setting.name)
    if len(matches) != 1:
        wanted = ", ".join(f"{name}={getattr(defaults, name)!r}" for name in _BATCHING_FIELDS)
        raise ValueError(f"exactly one kinference setting must match kinference's default batching ({wanted}); "
                         f"matching: {', '.join(matches) or 'none'}. "
                         "Update KINFERENCE_SETTINGS in loadgen/bench/bench.py")
    return matches[0]


@dataclass(frozen=True)
class Scenario:
    """A contender. ``serve`` (Kafka scenarios) is a context manager that runs it on the given bootstrap
    servers and topics until exit, in the contender's own process (``contender``); in-process ceilings
    have ``order`` instead."""

    name: str
    kind: Kind
    about: str
    serve: Serve | None = None
    """Picklable (``contender`` sends it to a child process)."""
    order: Literal["fifo", "grouped"] | None = None


def _per_message(bootstrap_servers: str, topic: str) -> LoopThread:
    return PerMessageLoop(bootstrap_servers, topic, MiniLM())


def _static_batches(size: int, bootstrap_servers: str, topic: str) -> LoopThread:
    return StaticBatchLoop(bootstrap_servers, topic, embedding_answers(MiniLM()), size, STATIC_DELAY_MS)


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("inproc-fifo", "ceiling",
             "the handler's validate/preprocess/inference/postprocess in a loop, corpus order", order="fifo"),
    Scenario("inproc-grouped", "ceiling", "the same with the corpus sorted by length before batching",
             order="grouped"),
    Scenario("relay", "transport", "plain confluent-kafka consume -> produce, values echoed",
             serve=partial(serve_loop, Relay)),
    Scenario("kinference-echo", "transport", "kinference (defaults) with the echo handler",
             serve=partial(serve_kinference, {}, "echo")),
    Scenario("per-message", "baseline", "poll one record, embed it, produce the reply",
             serve=partial(serve_loop, _per_message)),
    *(Scenario(f"torchserve-b{size}", "baseline",
               f"static batching (batch {size}, {STATIC_DELAY_MS:g} ms), stages one after another, one thread",
               serve=partial(serve_loop, partial(_static_batches, size)))
      for size in (8, 32)),
    *(Scenario(setting.name, "kinference", setting.about,
               serve=partial(serve_kinference, setting.overrides, "embedding"))
      for setting in KINFERENCE_SETTINGS),
)
_BY_NAME = {scenario.name: scenario for scenario in SCENARIOS}
SCENARIO_NAMES = tuple(_BY_NAME)


@dataclass(frozen=True)
class BenchOptions:
    concurrency: tuple[int, ...] = (1, 4, 16, 64, 256)
    corpora: tuple[str, ...] = ("mixed", "short")
    duration_s: float = 3.0
    warmup_s: float = 1.0
    timeout_s: float = 30.0
    scenarios: tuple[Scenario, ...] = SCENARIOS
    ceiling_batch_sizes: tuple[int, ...] = (1, 8, 32)
    seed: int = 0
    progress: bool = True
    command: str = "kinference bench"
    broker: str = "tansu"
    """The local broker of the Kafka scenarios: ``tansu`` (embedded) or ``kafka`` (Apache Kafka)."""

    def settings(self) -> dict[str, Any]:
        return {"broker": self.broker, "concurrency": list(self.concurrency), "corpora": list(self.corpora),
                "duration_s": self.duration_s,
                "warmup_s": self.warmup_s, "timeout_s": self.timeout_s, "seed": self.seed,
                "ceiling_batch_sizes": list(self.ceiling_batch_sizes), "default_setting": default_setting(),
                "scenarios": [s.name for s in self.scenarios]}


@dataclass
class Bench:
    """One bench run: owns the broker and the contenders it starts, and stops them at the end."""

    options: BenchOptions
    console: Console
    bootstrap_servers: str = ""
    broker_description: str = ""
    began: float = field(default_factory=time.monotonic)

    def run(self) -> dict[str, Any]:
        options = self.options
        load_before = loadavg()
        started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        payloads = {corpus: builtin_corpus(corpus, seed=options.seed) for corpus in options.corpora}
        ceilings = self._ceilings(payloads)
        runs = self._kafka_runs(payloads)
        report = {
            "command": options.command, "started": started, "wall_s": round(time.monotonic() - self.began, 1),
            "machine": {**machine(), "loadavg_start": load_before, "loadavg_end": loadavg()},
            "settings": options.settings(),
            "scenarios": [{"name": s.name, "kind": s.kind, "about": s.about} for s in options.scenarios],
            "ceilings": ceilings, "runs": runs,
            "broker": {"kind": options.broker, "description": self.broker_description},
        }
        report["targets"] = evaluate_targets(report)
        return report

    def _ceilings(self, payloads: dict[str, list[dict[str, str]]]) -> list[dict[str, Any]]:
        chosen = [s for s in self.options.scenarios if s.order is not None]
        if not chosen:
            return []
        self._step("loading the embedding handler for the in-process ceilings")
        handler = load_handler("embedding")
        handler.setup(HandlerContext(device=resolve_device("auto"), options=CUT,
                                     max_batch_size=max(self.options.ceiling_batch_sizes)))
        handler.warm_up()
        rows = []
        try:
            for scenario in chosen:
                for corpus, values in payloads.items():
                    self._step(f"{scenario.name} on the {corpus} corpus")
                    assert scenario.order is not None
                    rows.append({"scenario": scenario.name, "corpus": corpus,
                                 **measure_ceiling(handler, values, scenario.order,
                                                   self.options.ceiling_batch_sizes, self.options.duration_s)})
        finally:
            handler.close()
        return rows

    def _kafka_runs(self, payloads: dict[str, list[dict[str, str]]]) -> list[dict[str, Any]]:
        chosen = [s for s in self.options.scenarios if s.serve is not None]
        if not chosen:
            return []
        rows: list[dict[str, Any]] = []
        self._step(f"starting the broker ({self.options.broker})")
        with local_broker(self.options.broker) as broker:
            self.bootstrap_servers = broker.bootstrap_servers
            self.broker_description = broker.description
            for scenario in chosen:
                rows += self._measure(scenario, payloads)
        return rows

    def _measure(self, scenario: Scenario, payloads: dict[str, list[dict[str, str]]]) -> list[dict[str, Any]]:
        options = self.options
        suffix = uuid.uuid4().hex[:8]
        topics = {role: f"bench-{scenario.name}-{role}-{suffix}" for role in ("requests", "replies", "dead")}
        create_topics(self.bootstrap_servers, {topics["requests"]: 4, topics["replies"]: 4, topics["dead"]: 1})
        plan = LoadPlan(concurrency=options.concurrency[0], duration_s=options.duration_s,
                        warmup_s=options.warmup_s, timeout_s=options.timeout_s, seed=options.seed)
        rows = []
        self._step(f"{scenario.name}: starting its process")
        assert scenario.serve is not None
        with (contender(f"bench-{scenario.name}", scenario.serve, self.bootstrap_servers, topics),
              Client(self.bootstrap_servers, topics["requests"], topics["replies"], timeout_s=options.timeout_s,
                     reply_consumer=LOW_LATENCY_CONSUMER) as client):
            for corpus, values in payloads.items():
                self._step(f"{scenario.name} on the {corpus} corpus, concurrency {list(options.concurrency)}")
                with ProgressView(self.console, enabled=options.progress) as view:
                    results = asyncio.run(run_sweep(client, plan, options.concurrency, values, view))
                rows += [run_row(scenario, corpus, result) for result in results]
        return rows

    def _step(self, text: str) -> None:
        self.console.print(f"[dim]{time.monotonic() - self.began:6.1f} s[/dim]  {text}")


def run_row(scenario: Scenario, corpus: str, result: RunResult) -> dict[str, Any]:
    """The load generator's report of one run, with the scenario, the corpus and ``steady_rps``."""
    report = result.report()
    duration = result.plan.duration_s or 0.0
    return {"scenario": scenario.name, "kind": scenario.kind, "corpus": corpus,
            "steady_rps": round(report["sent"] / duration, 3) if duration else None, **report}


# --- targets (the issue's, as ratios within this run)

@dataclass(frozen=True)
class Target:
    """One target on one corpus (at one concurrency): the value measured and the limit it must reach."""

    text: str
    corpus: str
    concurrency: int | None
    value: float
    limit: float
    higher: bool
    """Met at or above ``limit``; else at or below it."""
    detail: str

    def row(self) -> dict[str, Any]:
        met = self.value >= self.limit if self.higher else self.value <= self.limit
        return {"target": self.text, "corpus": self.corpus, "concurrency": self.concurrency,
                "value": round(self.value, 3), "limit": round(self.limit, 3), "met": bool(met), "detail": self.detail}


def evaluate_targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target the run has the scenarios for: what was measured, the limit, and whether it is met. The
    setting judged is the report's ``settings.default_setting`` (``default_setting()`` when it ran)."""
    runs = {(r["scenario"], r["corpus"], r["concurrency"]): r for r in report["runs"]}
    ceilings = {(c["scenario"], c["corpus"]): c for c in report["ceilings"]}
    settings = report["settings"]
    top = max(settings["concurrency"])
    names = settings["scenarios"]
    judged = settings["default_setting"]
    contenders = [s["name"] for s in report["scenarios"]
                  if s["kind"] in ("baseline", "kinference") and s["name"] != judged]
    targets: list[Target] = []
    for corpus in settings["corpora"]:
        default = {c: runs.get((judged, corpus, c)) for c in settings["concurrency"]}
        at_top = default[top]
        grouped, fifo = ceilings.get(("inproc-grouped", corpus)), ceilings.get(("inproc-fifo", corpus))
        if at_top and corpus == "mixed" and grouped:
            targets.append(Target(">= 0.9x the length-grouped in-process ceiling", corpus, top,
                                  at_top["steady_rps"] / grouped["best_items_per_s"], 0.9, True,
                                  f"{at_top['steady_rps']:.1f} vs {grouped['best_items_per_s']:.1f} items/s "
                                  f"(batch {grouped['best_batch_size']})"))
        static = [runs[(n, corpus, top)] for n in names if n.startswith("torchserve-") and (n, corpus, top) in runs]
        if at_top and corpus == "mixed" and static:
            best = max(static, key=lambda r: r["steady_rps"])
            targets.append(Target(">= 2x static FIFO batching (best of the TorchServe baselines)", corpus, top,
                                  at_top["steady_rps"] / max(best["steady_rps"], 1e-9), 2.0, True,
                                  f"{at_top['steady_rps']:.1f} vs {best['scenario']} {best['steady_rps']:.1f} "
                                  "replies/s"))
        inproc = [c for c in (grouped, fifo) if c]
        if at_top and corpus == "short" and inproc:
            best_ceiling = max(inproc, key=lambda c: c["best_items_per_s"])
            targets.append(Target(">= 0.9x the best in-process ceiling", corpus, top,
                                  at_top["steady_rps"] / best_ceiling["best_items_per_s"], 0.9, True,
                                  f"{at_top['steady_rps']:.1f} vs {best_ceiling['scenario']} "
                                  f"{best_ceiling['best_items_per_s']:.1f}"))
        one = default.get(1)
        if one and fifo and fifo["batch1_latency_ms"]["p50"] is not None:
            batch1 = fifo["batch1_latency_ms"]["p50"]
            targets.append(Target("concurrency 1: p50 <= 1.2x in-process batch-1 latency + 5 ms", corpus, 1,
                                  one["latency_ms"]["p50"], 1.2 * batch1 + 5, False,
                                  f"p50 {one['latency_ms']['p50']:.1f} ms; batch-1 in-process p50 {batch1:.1f} ms"))
        others = {c: [runs[(n, corpus, c)] for n in contenders if (n, corpus, c) in runs] for c in default}
        targets += _against_the_others(corpus, default, others)
        echo, relay = runs.get(("kinference-echo", corpus, top)), runs.get(("relay", corpus, top))
        if echo and relay:
            targets.append(Target("echo handler >= 0.5x the relay", corpus, top,
                                  echo["steady_rps"] / max(relay["steady_rps"], 1e-9), 0.5, True,
                                  f"{echo['steady_rps']:.0f} vs {relay['steady_rps']:.0f} replies/s"))
    return [target.row() for target in targets]


def _against_the_others(corpus: str, default: dict[int, dict[str, Any] | None],
                        others: dict[int, list[dict[str, Any]]]) -> Iterator[Target]:
    """At each concurrency, the judged setting's run (``default``) against the other settings and baselines: none
    more than 5% faster, and its p99 within 1.2x the lowest of theirs."""
    for concurrency, mine in default.items():
        if not mine or not others[concurrency]:
            continue
        fastest = max(others[concurrency], key=lambda r: r["steady_rps"])
        yield Target("no other setting is more than 5% faster", corpus, concurrency,
                     fastest["steady_rps"] / max(mine["steady_rps"], 1e-9), 1.05, False,
                     f"{fastest['scenario']} {fastest['steady_rps']:.1f} vs {mine['steady_rps']:.1f} replies/s")
        tightest = min(others[concurrency], key=lambda r: r["latency_ms"]["p99"] or math.inf)
        if tightest["latency_ms"]["p99"] and mine["latency_ms"]["p99"]:
            yield Target("p99 <= 1.2x the lowest p99 of the others", corpus, concurrency,
                         mine["latency_ms"]["p99"] / tightest["latency_ms"]["p99"], 1.2, False,
                         f"{mine['latency_ms']['p99']:.1f} ms vs {tightest['scenario']} "
                         f"{tightest['latency_ms']['p99']:.1f} ms")


# --- output: tables, markdown, plot

def _grid(report: dict[str, Any], corpus: str, cell: Callable[[dict[str, Any]], str]) -> list[list[str]]:
    """One row per Kafka scenario, one column per concurrency."""
    runs = {(r["scenario"], r["concurrency"]): r for r in report["runs"] if r["corpus"] == corpus}
    rows = []
    for name in dict.fromkeys(r["scenario"] for r in report["runs"]):
        rows.append([name, *(cell(runs[(name, c)]) if (name, c) in runs else "-"
                             for c in report["settings"]["concurrency"])])
    return rows


def _rps(run: dict[str, Any]) -> str:
    flag = "" if run["ok"] == run["sent"] else "*"
    return f"{run['steady_rps']:.0f}{flag}" if run["steady_rps"] >= 100 else f"{run['steady_rps']:.1f}{flag}"


def _latency(run: dict[str, Any]) -> str:
    latency = run["latency_ms"]
    return " / ".join("-" if latency[k] is None else f"{latency[k]:.0f}" if latency[k] >= 100
                      else f"{latency[k]:.1f}" for k in ("p50", "p99"))


def tables(report: dict[str, Any]) -> Titled:
    """(title, header, rows) of every table of the report: the console and the markdown show these."""
    concurrency = [f"c={c}" for c in report["settings"]["concurrency"]]
    out = []
    if report["ceilings"]:
        sizes = report["settings"]["ceiling_batch_sizes"]
        out.append(("In-process ceilings (items/s by batch size; batch-1 latency)",
                    ["scenario", "corpus", *(f"b={s}" for s in sizes), "best", "b=1 p50 / p99 ms"],
                    [[c["scenario"], c["corpus"], *(f"{c['items_per_s'][str(s)]:.1f}" for s in sizes),
                      f"{c['best_items_per_s']:.1f} (b={c['best_batch_size']})", _latency(
                          {"latency_ms": c["batch1_latency_ms"]})] for c in report["ceilings"]]))
    for corpus in report["settings"]["corpora"]:
        if any(r["corpus"] == corpus for r in report["runs"]):
            out.append((f"{corpus} corpus: replies/s in the measured window (* = not every request ok)",
                        ["scenario", *concurrency], _grid(report, corpus, _rps)))
            out.append((f"{corpus} corpus: latency p50 / p99 (ms)", ["scenario", *concurrency],
                        _grid(report, corpus, _latency)))
    if report["targets"]:
        out.append((f"Targets ({report['settings']['default_setting']} is the default)",
                    ["target", "corpus", "conc", "value", "limit", "met", "detail"],
                    [[t["target"], t["corpus"], str(t["concurrency"]), f"{t['value']:g}", f"{t['limit']:g}",
                      "yes" if t["met"] else "NO", t["detail"]] for t in report["targets"]]))
    return out


def print_report(report: dict[str, Any], console: Console) -> None:
    if report.get("broker", {}).get("description"):
        console.print(f"broker: {report['broker']['description']}")
    print_tables(tables(report), console)
    console.print(f"wall time {report['wall_s']:.0f} s; load average before / after "
                  f"{report['machine']['loadavg_start']} / {report['machine']['loadavg_end']}")


def markdown(report: dict[str, Any]) -> str:
    """The report's tables in Markdown (for docs/benchmarks.md)."""
    return tables_markdown(report, tables(report))


def plot_bench(report: dict[str, Any], path: Path) -> Path:
    """One PNG: per corpus, the model scenarios against concurrency with the in-process ceilings as flat
    lines; then the transport scenarios. Each panel is ``loadgen.plot.plot_sweep``'s figure."""
    concurrency = report["settings"]["concurrency"]
    nan = float("nan")
    panels: list[tuple[str, list[tuple[str, list[dict[str, Any]]]]]] = []
    transport: list[tuple[str, list[dict[str, Any]]]] = []
    for corpus in report["settings"]["corpora"]:
        series: dict[str, list[dict[str, Any]]] = {}
        for run in report["runs"]:
            if run["corpus"] == corpus:
                series.setdefault(run["scenario"], []).append({**run, "throughput_rps": run["steady_rps"]})
        for ceiling in (c for c in report["ceilings"] if c["corpus"] == corpus):
            batch1 = ceiling["batch1_latency_ms"] if ceiling["scenario"] == "inproc-fifo" else {}
            series[f"{ceiling['scenario']} (b={ceiling['best_batch_size']}{'; b=1 latency' if batch1 else ''})"] = [
                {"concurrency": c, "throughput_rps": ceiling["best_items_per_s"],
                 "latency_ms": {k: batch1.get(k) or nan for k in ("p50", "p99")}} for c in concurrency]
        kinds = {s["name"]: s["kind"] for s in report["scenarios"]}
        model = [(name, runs) for name, runs in series.items() if kinds.get(name) != "transport"]
        transport += [(f"{name} ({corpus})", runs) for name, runs in series.items() if kinds.get(name) == "transport"]
        if model:
            panels.append((f"kinference bench, {corpus} corpus: model scenarios (flat lines: in-process ceilings)",
                           model))
    if transport:
        panels.append(("kinference bench: transport (relay ceiling and kinference's echo handler)", transport))
    if not panels:
        raise ValueError("nothing to plot")
    from matplotlib.image import imread, imsave

    with tempfile.TemporaryDirectory() as tmp:
        images = [imread(plot_sweep(series, Path(tmp) / f"{i}.png", title=title))
                  for i, (title, series) in enumerate(panels)]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    imsave(path, np.vstack(images))
    return path


# --- command line

def build_parser() -> argparse.ArgumentParser:
    scenarios = "\n".join(f"  {s.name:<24}{s.kind:<11}{s.about}" for s in SCENARIOS)
    parser = argparse.ArgumentParser(
        prog="kinference bench",
        # Raw: the scenario list below is a table; textwrap would also split names at their hyphens.
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run every scenario (ceilings, user-style baselines, kinference settings) on one local broker,\n"
                    "model and corpus; print tables, write JSON and a plot.",
        epilog=f"scenarios:\n{scenarios}\n\nEach Kafka scenario runs in a process of its own. The targets judge the "
               "kinference setting whose\nbatching matches kinference serve's defaults. See docs/benchmarks.md.\n\n"
               "kinference bench image [--help]: the image-classification scenario (micro-batching, preprocess "
               "threads).\nkinference bench gpu [--help]: each model's ceilings and drains of kinference serve at "
               "1..8 workers,\nwith the GPU's busy fraction and the CPU per message.\n"
               "kinference bench generate [--help]: continuous batching against a per-request generate() loop and "
               "static\nbatching, and kinference through Kafka (tokens/s, time to first chunk, time between chunks).",
    )
    parser.add_argument("--concurrency", type=concurrency_list, metavar="C1,C2,...",
                        help="closed-loop concurrencies (default: 1,4,16,64,256; --quick: 1,4)")
    parser.add_argument("--corpus", type=_corpora, metavar="NAME,...",
                        help=f"corpora, of {', '.join(PROFILES)} (default: mixed,short; --quick: short)")
    parser.add_argument("--duration", type=float, help="measured seconds per point (default: 3; --quick: 1)")
    parser.add_argument("--warmup", type=float, help="warm-up seconds per point, > 0 (default: 1; --quick: 0.5)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds before a request is lost (default: 30)")
    parser.add_argument("--scenarios", type=_scenarios, metavar="NAME,...",
                        help="run only these, of the scenarios below (default: all)")
    parser.add_argument("--ceiling-batch-sizes", type=concurrency_list, metavar="B1,B2,...",
                        help="in-process batch sizes to try (default: 1,8,32; --quick: 1,8)")
    parser.add_argument("--seed", type=int, default=0, help="corpus seed (default: 0)")
    parser.add_argument("--broker", choices=BROKER_KINDS, default="tansu",
                        help="the local broker: tansu (embedded, pip-only) or kafka (Apache Kafka from Maven Central; "
                             "needs a JDK 17+ and Maven) (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="a tiny run: smoke test of the whole command")
    parser.add_argument("--plot", type=Path, help="write the PNG plot here")
    add_report_arguments(parser)
    parser.add_argument("--no-progress", action="store_true", help="no live progress bars")
    return parser


def options_from(args: argparse.Namespace, argv: Sequence[str]) -> BenchOptions:
    quick = args.quick

    def pick(value: Any, normal: Any, small: Any) -> Any:
        return value if value is not None else small if quick else normal

    warmup = pick(args.warmup, 1.0, 0.5)
    duration = pick(args.duration, 3.0, 1.0)
    if warmup <= 0 or duration <= 0 or args.timeout <= 0:
        # steady_rps needs every worker busy when measuring begins: some warm-up is required.
        raise ValueError("--warmup, --duration and --timeout must be positive")
    scenarios = tuple(s for s in SCENARIOS if s.name in set(args.scenarios or SCENARIO_NAMES))
    default_setting()  # a setting kinference does not accept, or no clear default, fails here, not half-way through
    return BenchOptions(
        concurrency=tuple(pick(args.concurrency, (1, 4, 16, 64, 256), (1, 4))),
        corpora=tuple(pick(args.corpus, ("mixed", "short"), ("short",))),
        duration_s=duration, warmup_s=warmup, timeout_s=args.timeout,
        scenarios=scenarios,
        ceiling_batch_sizes=tuple(pick(args.ceiling_batch_sizes, (1, 8, 32), (1, 8))),
        seed=args.seed, progress=not args.no_progress, command=" ".join(["kinference bench", *argv]),
        broker=args.broker)


def main(argv: list[str]) -> int:
    if argv[:1] == ["image"]:
        from kinference.loadgen.bench import image

        return image.main(argv[1:])
    if argv[:1] == ["gpu"]:
        from kinference.loadgen.bench import gpu

        return gpu.main(argv[1:])
    if argv[:1] == ["generate"]:
        from kinference.loadgen.bench import generative

        return generative.main(argv[1:])
    args, options = parse_options(build_parser(), argv, lambda args: options_from(args, argv))
    console, report = measured("kinference bench", lambda console: Bench(options, console).run())
    if report is None:
        return 1
    print_report(report, console)
    for path in write_reports(report, args, markdown):
        console.print(f"written: {path}")
    if args.plot:
        plot_bench(report, args.plot)
        console.print(f"plot: {args.plot}")
    return 0


def _corpora(text: str) -> list[str]:
    names = [item.strip() for item in text.split(",") if item.strip()]
    unknown = [name for name in names if name not in PROFILES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"corpora are {', '.join(PROFILES)}; got {text!r}")
    return names


def _scenarios(text: str) -> list[str]:
    names = [item.strip() for item in text.split(",") if item.strip()]
    unknown = [name for name in names if name not in SCENARIO_NAMES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"unknown scenario(s) {', '.join(unknown) or text!r}; "
                                         f"known: {', '.join(SCENARIO_NAMES)}")
    return names


