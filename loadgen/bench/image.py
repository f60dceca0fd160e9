"""``kinference bench image``: TorchServe's micro-batching claim on image classification, measured in one run.

The claim: when decoding images on the CPU costs about as much as inference, running preprocess, inference and
postprocess of different micro-batches in parallel threads keeps the model busy while the CPU decodes. Every
figure comes from this run, on this machine, with the real ``image-classification`` handler:

- the corpus: JPEGs from 320x240 to 1920x1080 generated at start (gradients, shapes and noise, quality 85);
- the model: a small ResNet-like CNN in plain torch (no torchvision), saved as TorchScript with its labels;
- the costs: ``d``, one thread's decode + resize + crop + normalise time per image (the handler's
  ``preprocess``), and ``i``, inference time per image at the micro-batch size (the handler's ``inference``),
  with the CPU time it takes (``i_cpu``: more than ``i`` when torch runs several threads);
- the in-process pipelined ceiling: decoding in a thread pool feeding the model in this process, no Kafka;
- the TorchServe-style static loop: a batch of ``static_batch`` (or what came in 50 ms), then decode, infer,
  postprocess and reply one after another in one thread;
- kinference with its defaults, and with ``--parallelism preprocess=N`` with and without ``--micro-batch-size``,
  each in a process of its own, loaded in closed loop at ``concurrency`` through one embedded broker.

Inference busy is the time inside inference calls over the measured wall time (summed over inference threads).
Every contender runs torch with ``torch_threads`` intra-op threads (default 1): on a small CPU machine that
leaves the other cores to decoding, as an accelerator would; with torch on every core, inference and decoding
take turns on the same cores and no thread count can overlap them (the prediction then says so).

The prediction. With one preprocess thread overlapping inference, a process serves at most
``min(1/d, 1/i)`` images per second; with N preprocess threads ``min(min(N, C)/d, 1/i)``. Decoding and
inference share the cores, so neither can pass ``C / (d + i_cpu)``:

    X(N) = min(N / d, 1 / i, C / (d + i_cpu)),   predicted gain of N threads over one = X(N) / X(1)

(``C/(d + i_cpu)`` is below ``C/d``, so ``min(N, C)/d`` needs no term of its own). C is measured, not the
machine's core count: the corpus decoded in as many threads as there are cores, against one thread's ``d``.
That counts what decoding really gets of a shared machine, and what the GIL takes back (Pillow releases it
while it decodes and resizes, not while the handler builds tensors). The broker and the load generator share
the cores too, so every rate measured through Kafka is below its X; each run reports the CPU per image of the
contender, the broker and the load generator, so the table shows what the Kafka path costs.

The targets: kinference's defaults reach >= 0.9x the pipelined ceiling, and the best tuned setting beats one
preprocess thread by at least 0.9x the predicted gain.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import io
import os
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw
from rich.console import Console
from torch import nn

from kinference.consumer.brokers.broker import LOW_LATENCY_CONSUMER, EmbeddedBroker
from kinference.consumer.ops.topics import create_topics
from kinference.handlers import Handler, HandlerContext, load_handler
from kinference.loadgen.bench.baselines import STATIC_DELAY_MS, Answer, LoopThread, StaticBatchLoop
from kinference.loadgen.bench.command import measured, parse_options
from kinference.loadgen.bench.contender import Serve, contender
from kinference.loadgen.bench.machine import machine, machine_cpu_s, process_cpu_s
from kinference.loadgen.bench.outputs import Titled, add_report_arguments, print_tables, tables_markdown, write_reports
from kinference.loadgen.bench.serve import serve_kinference, serve_loop
from kinference.loadgen.client import Client
from kinference.loadgen.live import ProgressView
from kinference.loadgen.runner import LoadPlan, run_load
from kinference.protocol import encode_result

SIZES = ((320, 240), (640, 480), (800, 600), (1024, 768), (1280, 720), (1600, 900), (1920, 1080))
LABELS = [f"class-{index}" for index in range(10)]
HANDLER = "image-classification"


def jpeg_corpus(count: int, seed: int = 0) -> list[bytes]:
    """``count`` photo-like JPEGs, sizes cycling through ``SIZES`` (so every size is equally common)."""
    rng = np.random.default_rng(seed)
    images = []
    for index in range(count):
        width, height = SIZES[index % len(SIZES)]
        x, y = np.meshgrid(np.linspace(0, 1, width, dtype=np.float32), np.linspace(0, 1, height, dtype=np.float32))
        phase = rng.uniform(0, 6.28, 3)
        channels = [0.5 + 0.5 * np.sin(6 * x * (c + 1) + 4 * y + phase[c]) for c in range(3)]
        pixels = np.stack(channels, axis=-1) * 200 + rng.normal(0, 12, (height, width, 3))
        image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
        draw = ImageDraw.Draw(image)
        for _ in range(6):
            left, top = int(rng.integers(0, width - 20)), int(rng.integers(0, height - 20))
            box = (left, top, left + int(rng.integers(10, width // 3)), top + int(rng.integers(10, height // 3)))
            draw.ellipse(box, fill=tuple(int(v) for v in rng.integers(0, 255, 3)))
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", quality=85)
        images.append(buffer.getvalue())
    return images


class SmallResNet(nn.Module):
    """Four strided residual stages, global pooling, a linear head: the shape of an image classifier, small
    enough that its per-image time is of the order of the per-image decode time on a CPU."""

    def __init__(self, width: int = 24, classes: int = len(LABELS)) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 5, stride=4, padding=2), nn.BatchNorm2d(width), nn.ReLU())
        stages = []
        for index in range(3):
            channels = width * 2 ** index
            stages += [_Residual(channels), nn.Conv2d(channels, channels * 2, 3, stride=2, padding=1), nn.ReLU()]
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(width * 8, classes)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.stages(self.stem(pixels)).mean(dim=(2, 3)))
        return logits


class _Residual(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
                                  nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.body(x))


def save_model(directory: Path, seed: int = 0) -> Path:
    """The model (random weights) as TorchScript and its labels, in ``directory``: the handler's ``--model``."""
    torch.manual_seed(seed)
    directory.mkdir(parents=True, exist_ok=True)
    torch.jit.script(SmallResNet().eval()).save(str(directory / "model.pt"))
    (directory / "labels.txt").write_text("\n".join(LABELS) + "\n")
    return directory


def predicted_rate(threads: int, decode_s: float, infer_s: float, infer_cpu_s: float, cores: float) -> float:
    """Images per second with ``threads`` preprocess threads overlapping inference (see the module docstring)."""
    return min(threads / decode_s, 1 / infer_s, cores / (decode_s + infer_cpu_s))


# --- in-process measurements


def loaded_handler(model: Path, max_batch_size: int) -> Handler:
    handler = load_handler(HANDLER)
    handler.setup(HandlerContext(device="cpu", model=model, max_batch_size=max_batch_size))
    handler.warm_up()
    return handler


def measure_costs(handler: Handler, items: list[Any], batch: int) -> dict[str, float]:
    """``d``, ``i`` and ``i_cpu`` in ms per image: one preprocess thread per image, inference per image at
    ``batch`` (wall and process CPU time)."""
    began = time.perf_counter()
    for item in items:
        handler.preprocess([item])
    decode_ms = (time.perf_counter() - began) * 1000 / len(items)
    batches = [handler.preprocess(items[start:start + batch]) for start in range(0, len(items) - batch + 1, batch)]
    handler.inference(batches[0])  # this shape's first call
    began, cpu = time.perf_counter(), time.process_time()
    for pixels in batches:
        handler.inference(pixels)
    images = len(batches) * batch
    infer_ms = (time.perf_counter() - began) * 1000 / images
    infer_cpu_ms = (time.process_time() - cpu) * 1000 / images
    return {"decode_ms": round(decode_ms, 3), "infer_ms": round(infer_ms, 3), "infer_cpu_ms": round(infer_cpu_ms, 3)}


def available_cores(handler: Handler, items: list[Any], cpus: int, decode_s: float) -> float:
    """The cores decoding gets here and now (the prediction's C): ``items`` decoded one at a time in ``cpus``
    threads at once, their images per second against one thread's ``1/d``, at most ``cpus``."""
    began = time.perf_counter()
    with ThreadPoolExecutor(cpus) as pool:
        decoded = sum(1 for _ in pool.map(handler.preprocess, ([item] for item in items * cpus)))
    return round(min(float(cpus), decoded / (time.perf_counter() - began) * decode_s), 2)


def cpu_now(*pids: int) -> tuple[float, ...]:
    """CPU seconds so far of each process in ``pids``, then of the whole machine."""
    return (*(process_cpu_s(pid) for pid in pids), machine_cpu_s())


def pipelined_ceiling(handler: Handler, items: list[Any], workers: int, micro: int, seconds: float
                      ) -> dict[str, float]:
    """Images per second with ``workers`` threads decoding micro-batches of ``micro`` ahead of the model, which
    runs in this thread (inference + postprocess), for about ``seconds``; the fraction of it in inference, and the
    process's CPU time per image."""
    chunks = [items[start:start + micro] for start in range(0, len(items), micro)]
    done, busy = 0, 0.0
    with ThreadPoolExecutor(workers) as pool:
        ahead = [pool.submit(handler.preprocess, chunks[index % len(chunks)]) for index in range(2 * workers)]
        began, cpu, index = time.perf_counter(), time.process_time(), 2 * workers
        while time.perf_counter() - began < seconds:
            inputs = ahead.pop(0).result()
            ahead.append(pool.submit(handler.preprocess, chunks[index % len(chunks)]))
            chunk = chunks[(index - 2 * workers) % len(chunks)]
            index += 1
            start = time.perf_counter()
            outputs = handler.inference(inputs)
            busy += time.perf_counter() - start
            handler.postprocess(outputs, chunk)
            done += len(chunk)
        elapsed, cpu_s = time.perf_counter() - began, time.process_time() - cpu
        for future in ahead:
            future.result()
    return {"images_per_s": round(done / elapsed, 2), "inference_busy": round(busy / elapsed, 3),
            "cpu_ms": round(cpu_s * 1000 / done, 2)}


# --- Kafka contenders (module-level, so that they pickle into their own process)


class ImageAnswer:
    """The image handler's four calls on one batch, one after another, timing inference: a static loop's
    ``Answer``."""

    def __init__(self, model: Path, batch_size: int, torch_threads: int) -> None:
        torch.set_num_threads(torch_threads)  # this contender's own process: what kinference's --torch-threads does
        self.handler = loaded_handler(model, batch_size)
        self.inference_s = 0.0

    def __call__(self, values: list[bytes]) -> list[bytes]:
        checked = self.handler.validate_many(values)
        items = [item for item in checked if not isinstance(item, Exception)]
        if len(items) != len(values):
            raise ValueError("the image corpus holds only valid images")
        inputs = self.handler.preprocess(items)
        start = time.perf_counter()
        outputs = self.handler.inference(inputs)
        self.inference_s += time.perf_counter() - start
        return [encode_result(result) for result in self.handler.postprocess(outputs, items)]

    def stats(self) -> dict[str, float]:
        return {"inference_s": self.inference_s}


def _static_images(model: Path, size: int, torch_threads: int, bootstrap_servers: str, topic: str) -> LoopThread:
    answer: Answer = ImageAnswer(model, size, torch_threads)
    return StaticBatchLoop(bootstrap_servers, topic, answer, size, STATIC_DELAY_MS)


@dataclass(frozen=True)
class ImageScenario:
    name: str
    about: str
    serve: Serve
    preprocess_threads: int | None = None
    """For kinference scenarios: the preprocess threads it runs with."""


@dataclass(frozen=True)
class ImageBenchOptions:
    images: int = 70
    concurrency: int = 64
    duration_s: float = 8.0
    warmup_s: float = 3.0
    timeout_s: float = 60.0
    threads: tuple[int, ...] = (2, 4)
    micro_batch_size: int = 8
    max_batch_size: int = 32
    static_batch: int = 8
    torch_threads: int = 1
    seed: int = 0
    progress: bool = True
    command: str = "kinference bench image"


def scenarios(options: ImageBenchOptions, model: Path) -> list[ImageScenario]:
    def kinference(name: str, about: str, threads: int, micro: int | None, defaults: bool = False) -> ImageScenario:
        overrides: dict[str, Any] = {"model": model, "torch_threads": options.torch_threads}
        if not defaults:
            overrides |= {"max_batch_size": options.max_batch_size, "micro_batch_size": micro,
                          "parallelism": {"preprocess": threads, "inference": 1, "postprocess": 1}}
        return ImageScenario(name, about, partial(serve_kinference, overrides, HANDLER), threads)

    chosen = [
        ImageScenario(f"torchserve-static-b{options.static_batch}",
                      f"static batch {options.static_batch} ({STATIC_DELAY_MS:g} ms), stages one after another",
                      partial(serve_loop, partial(_static_images, model, options.static_batch,
                                                  options.torch_threads))),
        kinference("kinference-default", "kinference serve's batching and stage defaults (1 preprocess thread, "
                   "no micro-batches)", 1,
                   None, defaults=True),
        kinference(f"preprocess=1,micro={options.micro_batch_size}", "one preprocess thread, micro-batches", 1,
                   options.micro_batch_size),
    ]
    for threads in options.threads:
        chosen += [kinference(f"preprocess={threads}", f"{threads} preprocess threads, whole batches", threads, None),
                   kinference(f"preprocess={threads},micro={options.micro_batch_size}",
                              f"{threads} preprocess threads, micro-batches of {options.micro_batch_size}", threads,
                              options.micro_batch_size)]
    return chosen


@dataclass
class ImageBench:
    options: ImageBenchOptions
    console: Console

    def run(self) -> dict[str, Any]:
        options = self.options
        began = time.monotonic()
        started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        load_before = os.getloadavg()
        with tempfile.TemporaryDirectory(prefix="kinference-image-bench-") as scratch:
            model = save_model(Path(scratch) / "model", options.seed)
            self._step(f"generating {options.images} JPEGs ({SIZES[0][0]}x{SIZES[0][1]} to "
                       f"{SIZES[-1][0]}x{SIZES[-1][1]})")
            corpus = jpeg_corpus(options.images, options.seed)
            inproc = self._in_process(model, corpus)
            runs = self._kafka_runs(model, corpus)
        report = {
            "command": options.command, "started": started, "wall_s": round(time.monotonic() - began, 1),
            "machine": {**machine(), "loadavg_start": [round(x, 2) for x in load_before],
                        "loadavg_end": [round(x, 2) for x in os.getloadavg()]},
            "settings": {key: getattr(options, key) for key in ("images", "concurrency", "duration_s", "warmup_s",
                                                                 "threads", "micro_batch_size", "max_batch_size",
                                                                 "static_batch", "torch_threads", "seed")},
            "corpus": {"images": len(corpus), "mean_kb": round(sum(map(len, corpus)) / len(corpus) / 1024, 1)},
            **inproc, "runs": runs,
        }
        report["targets"] = evaluate_targets(report)
        return report

    def _in_process(self, model: Path, corpus: list[bytes]) -> dict[str, Any]:
        options = self.options
        threads_before = torch.get_num_threads()
        torch.set_num_threads(options.torch_threads)
        handler = loaded_handler(model, options.max_batch_size)
        try:
            items = handler.validate_many(corpus)
            self._step("measuring decode (d) and inference (i) per image")
            costs = measure_costs(handler, items, options.micro_batch_size)
            cpus = os.cpu_count() or 1
            self._step(f"measuring the cores decoding gets (C): {cpus} threads decoding at once")
            costs["cores_available"] = available_cores(handler, items, cpus, costs["decode_ms"] / 1000)
            ceilings = []
            for workers in sorted({1, *options.threads}):
                self._step(f"in-process pipelined ceiling, {workers} decode thread(s)")
                ceilings.append({"decode_threads": workers,
                                 **pipelined_ceiling(handler, items, workers, options.micro_batch_size,
                                                     options.duration_s)})
        finally:
            handler.close()
            torch.set_num_threads(threads_before)
        return {"costs": costs, "ceilings": ceilings}

    def _kafka_runs(self, model: Path, corpus: list[bytes]) -> list[dict[str, Any]]:
        options = self.options
        plan = LoadPlan(concurrency=options.concurrency, duration_s=options.duration_s, warmup_s=options.warmup_s,
                        timeout_s=options.timeout_s, seed=options.seed)
        rows = []
        self._step("starting the embedded broker")
        with EmbeddedBroker() as broker:
            broker_pid = broker.pid
            assert broker_pid is not None, "an embedded broker that started has a process"
            for scenario in scenarios(options, model):
                suffix = uuid.uuid4().hex[:8]
                topics = {role: f"image-{role}-{suffix}" for role in ("requests", "replies", "dead")}
                create_topics(broker.bootstrap_servers, {topics["requests"]: 4, topics["replies"]: 4,
                                                         topics["dead"]: 1})
                self._step(f"{scenario.name}: {scenario.about}")
                with (contender(f"image-{scenario.name}", scenario.serve, broker.bootstrap_servers, topics) as running,
                      Client(broker.bootstrap_servers, topics["requests"], topics["replies"],
                             timeout_s=options.timeout_s, reply_consumer=LOW_LATENCY_CONSUMER) as client,
                      ProgressView(self.console, enabled=options.progress) as view):
                    before = running.ready.get("inference_s", 0.0)
                    answered, start = client.stats().answered, time.monotonic()
                    # The load generator is this process: its event loop, the client and the progress view.
                    pids = running.pid, broker_pid, os.getpid()
                    cpu = cpu_now(*pids)
                    result = asyncio.run(run_load(client, plan, corpus, view, scenario.name))
                    # Inference runs only while the load runs (warm-up, window, the last replies): its wall time.
                    loaded_s = time.monotonic() - start
                    images = client.stats().answered - answered
                    cpu_ms = {f"{who}_cpu_ms": round((after - before_s) * 1000 / images, 2)
                              for who, after, before_s in zip(("contender", "broker", "loadgen", "machine"),
                                                              cpu_now(*pids), cpu, strict=True)}
                busy = running.stopped.get("inference_s", 0.0) - before
                report = result.report()
                rows.append({"scenario": scenario.name, "about": scenario.about,
                             "preprocess_threads": scenario.preprocess_threads,
                             "images_per_s": round(report["sent"] / options.duration_s, 2),
                             "inference_busy": round(min(1.0, busy / loaded_s), 3),
                             **cpu_ms,
                             **report})
        return rows

    def _step(self, text: str) -> None:
        self.console.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim]  {text}")


def evaluate_targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    runs = {run["scenario"]: run for run in report["runs"]}
    ceiling = max(report["ceilings"], key=lambda row: row["images_per_s"])
    costs = report["costs"]
    seconds = {key: costs[f"{key}_ms"] / 1000 for key in ("decode", "infer", "infer_cpu")}
    cores, available = report["machine"]["cpus"], costs["cores_available"]
    targets = []
    default = runs.get("kinference-default")
    if default is not None:
        ratio = default["images_per_s"] / ceiling["images_per_s"]
        cap = cores * 1000 / default["machine_cpu_ms"]
        targets.append({"target": "kinference defaults >= 0.9x the in-process pipelined ceiling",
                        "value": round(ratio, 3), "limit": 0.9, "met": ratio >= 0.9,
                        "detail": f"{default['images_per_s']:.1f} against {ceiling['images_per_s']:.1f} images/s "
                                  f"({ceiling['decode_threads']} decode threads); through Kafka the machine spent "
                                  f"{default['machine_cpu_ms']:.1f} ms CPU per image against the ceiling's "
                                  f"{ceiling['cpu_ms']:.1f}, so its {cores} cores cap it at {cap:.0f} images/s"})
    single = [run for run in report["runs"] if run["preprocess_threads"] == 1]
    tuned = [run for run in report["runs"] if (run["preprocess_threads"] or 1) > 1]
    if single and tuned:
        one, best = max(single, key=_rate), max(tuned, key=_rate)
        threads = best["preprocess_threads"]
        costs_s = seconds["decode"], seconds["infer"], seconds["infer_cpu"]
        predicted = predicted_rate(threads, *costs_s, available) / predicted_rate(1, *costs_s, available)
        measured = best["images_per_s"] / one["images_per_s"]
        kafka = _through_kafka(best, threads, seconds, cores) / _through_kafka(one, 1, seconds, cores)
        targets.append({"target": "tuned parallelism beats one preprocess thread by >= 0.9x the predicted gain",
                        "value": round(measured, 3), "limit": round(0.9 * predicted, 3),
                        "met": measured >= 0.9 * predicted,
                        "detail": f"{best['scenario']} / {one['scenario']}: measured {measured:.2f}x, predicted "
                                  f"X({threads})/X(1) = {predicted:.2f}x from d={costs['decode_ms']:.2f} ms, "
                                  f"i={costs['infer_ms']:.2f} ms, i_cpu={costs['infer_cpu_ms']:.2f} ms, "
                                  f"C={available:g} of {cores} cores; with the machine CPU each spent per image "
                                  f"through Kafka (m) in place of d + i_cpu, X({threads})/X(1) = {kafka:.2f}x"})
    return targets


def _through_kafka(run: dict[str, Any], threads: int, seconds: dict[str, float], cores: int) -> float:
    """The prediction with the run's own machine CPU per image (model, Kafka client, broker, service)."""
    rate: float = min(threads / seconds["decode"], 1 / seconds["infer"], cores * 1000 / run["machine_cpu_ms"])
    return rate


def _rate(run: dict[str, Any]) -> float:
    rate: float = run["images_per_s"]
    return rate


def tables(report: dict[str, Any]) -> Titled:
    costs = report["costs"]
    ceiling = max(row["images_per_s"] for row in report["ceilings"])
    out = [("Per-image costs (one thread) and the in-process pipelined ceiling",
            ["measure", "value"],
            [["d: decode+resize+crop+normalise", f"{costs['decode_ms']:.2f} ms"],
             [f"i: inference at batch {report['settings']['micro_batch_size']} "
              f"({report['settings']['torch_threads']} torch threads)",
              f"{costs['infer_ms']:.2f} ms ({costs['infer_cpu_ms']:.2f} ms CPU)"],
             ["C: cores decoding gets (measured)", f"{costs['cores_available']:g} of {report['machine']['cpus']}"],
             *([f"ceiling, {row['decode_threads']} decode thread(s)",
                f"{row['images_per_s']:.1f} images/s, inference busy {row['inference_busy']:.0%}, "
                f"{row['cpu_ms']:.1f} ms CPU/image"]
               for row in report["ceilings"])]),
           (f"Through Kafka at concurrency {report['settings']['concurrency']} "
            f"({report['corpus']['images']} JPEGs, mean {report['corpus']['mean_kb']} KB)",
            ["scenario", "images/s", "x ceiling", "inference busy", "CPU ms/image: contender", "broker",
             "load gen", "machine", "x CPU cap", "p50 ms", "p99 ms", "errors"],
            [[run["scenario"], f"{run['images_per_s']:.1f}", f"{run['images_per_s'] / ceiling:.2f}",
              f"{run['inference_busy']:.0%}",
              *(f"{run[f'{who}_cpu_ms']:.1f}" for who in ("contender", "broker", "loadgen", "machine")),
              f"{run['images_per_s'] * run['machine_cpu_ms'] / 1000 / report['machine']['cpus']:.2f}",
              *(f"{(run['latency_ms'] or {}).get(k) or 0:.0f}" for k in ("p50", "p99")),
              str(sum(run["errors"].values()) + run["lost"])] for run in report["runs"]])]
    if report["targets"]:
        out.append(("Targets", ["target", "value", "limit", "met", "detail"],
                    [[t["target"], f"{t['value']:g}", f"{t['limit']:g}", "yes" if t["met"] else "NO", t["detail"]]
                     for t in report["targets"]]))
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kinference bench image",
                                     description="Image classification: kinference's stage threads against an "
                                     "in-process pipelined ceiling and a TorchServe-style static loop, in one run. "
                                     "See docs/benchmarks.md.")
    parser.add_argument("--images", type=int, help="JPEGs in the corpus (default: 70; --quick: 14)")
    parser.add_argument("--concurrency", type=int, default=64, help="closed-loop concurrency (default: 64)")
    parser.add_argument("--duration", type=float, help="measured seconds per scenario (default: 8; --quick: 2)")
    parser.add_argument("--warmup", type=float, help="warm-up seconds per scenario (default: 3; --quick: 1)")
    parser.add_argument("--threads", type=lambda text: tuple(int(x) for x in text.split(",")), metavar="N1,N2",
                        help="preprocess thread counts to try beside 1 (default: 2,4; --quick: 2)")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="micro-batch size (default: 8)")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch intra-op threads of every contender (default: 1, see docs/benchmarks.md)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a short run: smoke test of the whole command")
    add_report_arguments(parser)
    parser.add_argument("--no-progress", action="store_true", help="no live progress bars")
    return parser


def options_from(args: argparse.Namespace, argv: list[str]) -> ImageBenchOptions:
    def pick(value: Any, normal: Any, quick: Any) -> Any:
        return value if value is not None else quick if args.quick else normal

    options = ImageBenchOptions(
        images=pick(args.images, 70, 14), concurrency=args.concurrency, duration_s=pick(args.duration, 8.0, 2.0),
        warmup_s=pick(args.warmup, 3.0, 1.0), threads=pick(args.threads, (2, 4), (2,)),
        micro_batch_size=args.micro_batch_size, torch_threads=args.torch_threads, seed=args.seed,
        progress=not args.no_progress, command=" ".join(["kinference bench image", *argv]))
    if (options.images < options.micro_batch_size or min(options.threads) < 2 or options.duration_s <= 0
            or options.warmup_s <= 0 or options.torch_threads < 1):
        raise ValueError("--images must be at least --micro-batch-size, --threads each >= 2, --duration, "
                         "--warmup and --torch-threads positive")
    return options


def main(argv: list[str]) -> int:
    args, options = parse_options(build_parser(), argv, lambda args: options_from(args, argv))
    console, report = measured("kinference bench image", lambda console: ImageBench(options, console).run())
    if report is None:
        return 1
    print_tables(tables(report), console)
    for path in write_reports(report, args, lambda r: tables_markdown(r, tables(r))):
        console.print(f"written: {path}")
    return 0
