"""Runs load against kinference with the request-reply client, on one asyncio event loop.

Closed loop (``concurrency``): that many workers, each sending its next request when the last one
is answered (like ``ab -c``). Open loop (``rate``): requests are due at constant or Poisson
intervals whatever the replies do, and latency counts from when a request was *due*, so a sender
that falls behind does not hide queueing (no coordinated omission). Requests sent during the
warm-up are not measured.

A generative plan (``generative``) sends each request with ``Client.stream_async`` and reads its chunk records as
they come: its latency is the whole generation's, and its sample adds the time to the first chunk, the times between
chunks, the tokens and the finish reason.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import numpy as np

from kinference.loadgen.client import Client
from kinference.loadgen.errors import DeliveryFailed, ReplyError, RequestTimeout, TooManyPending
from kinference.loadgen.live import LiveStats, ProgressView
from kinference.loadgen.report import Sample, build_report
from kinference.loadgen.stream import StreamGap

_TICK_S = 0.25


@dataclass(frozen=True)
class LoadPlan:
    """What to run. Exactly one of ``concurrency`` / ``rate``; at most one of ``requests`` /
    ``duration_s`` (neither: 10 s)."""

    concurrency: int | None = None
    rate: float | None = None
    arrivals: Literal["constant", "poisson"] = "poisson"
    requests: int | None = None
    duration_s: float | None = None
    warmup_s: float = 1.0
    timeout_s: float = 10.0
    seed: int = 0
    generative: bool = False
    """Stream each request (an OpenAI chat-completions body) and measure its chunks."""

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("give exactly one of concurrency (closed loop) and rate (open loop)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"rate must be positive, got {self.rate}")
        if self.requests is not None and self.duration_s is not None:
            raise ValueError("give at most one of requests and duration")
        if self.requests is not None and self.requests < 1:
            raise ValueError(f"requests must be at least 1, got {self.requests}")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError(f"duration must be positive, got {self.duration_s}")
        if self.warmup_s < 0 or self.timeout_s <= 0:
            raise ValueError("warmup must be >= 0 and timeout > 0")
        if self.requests is None and self.duration_s is None:
            object.__setattr__(self, "duration_s", 10.0)

    @property
    def mode(self) -> str:
        return "closed" if self.concurrency is not None else "open"

    def settings(self) -> dict[str, Any]:
        """The plan as report fields."""
        return {"mode": self.mode, **{k: v for k, v in asdict(self).items() if k != "seed"}}


@dataclass
class RunResult:
    plan: LoadPlan
    samples: list[Sample] = field(default_factory=list)
    duplicates: int = 0
    late: int = 0

    def report(self) -> dict[str, Any]:
        return build_report(self.samples, duplicates=self.duplicates, late=self.late,
                            settings=self.plan.settings(), generative=self.plan.generative)


async def run_load(client: Client, plan: LoadPlan, payloads: Sequence[Any],
                   view: ProgressView | None = None, label: str = "run") -> RunResult:
    """Run ``plan``, cycling through ``payloads``; ``view`` shows live progress."""
    before = client.stats()
    result = RunResult(plan)
    run = _Run(client, plan, payloads, result.samples)
    ticker = None
    if view is not None:
        view.begin("warm-up" if plan.warmup_s else label, plan.requests or plan.duration_s or 0)
        ticker = asyncio.create_task(run.tick(view, label))
    try:
        await (run.closed_loop() if plan.concurrency is not None else run.open_loop())
    finally:
        if ticker is not None:
            ticker.cancel()
    if view is not None:
        run.show(view, label)
    after = client.stats()
    result.duplicates = after.duplicates - before.duplicates
    result.late = after.late - before.late
    return result


async def run_sweep(client: Client, plan: LoadPlan, concurrencies: Sequence[int],
                    payloads: Sequence[Any], view: ProgressView | None = None) -> list[RunResult]:
    """One closed-loop run per concurrency, in order, each with its own warm-up."""
    return [await run_load(client, replace(plan, concurrency=c, rate=None), payloads, view, f"c={c}")
            for c in concurrencies]


class _Run:
    def __init__(self, client: Client, plan: LoadPlan, payloads: Sequence[Any],
                 samples: list[Sample]) -> None:
        if not payloads:
            raise ValueError("no payloads to send")
        self.client = client
        self.plan = plan
        self.samples = samples
        self.live = LiveStats()
        self.start = time.monotonic()
        self.measured_from = self.start + plan.warmup_s
        self.measured_issued = 0
        self._payloads = itertools.cycle(payloads)

    def _issue(self, at: float) -> tuple[bool, bool]:
        """(may a request be sent at ``at``, is it measured)."""
        if at < self.measured_from:
            return True, False
        if self.plan.requests is not None:
            more = self.measured_issued < self.plan.requests
        else:
            assert self.plan.duration_s is not None
            more = at < self.measured_from + self.plan.duration_s
        self.measured_issued += more
        return more, more

    async def closed_loop(self) -> None:
        async def worker() -> None:
            while True:
                due = time.monotonic()
                more, measured = self._issue(due)
                if not more:
                    return
                await self._one(due, measured)

        assert self.plan.concurrency is not None
        await asyncio.gather(*(worker() for _ in range(self.plan.concurrency)))

    async def open_loop(self) -> None:
        assert self.plan.rate is not None
        rng = random.Random(self.plan.seed)
        interval = 1.0 / self.plan.rate
        due = self.start
        running: set[asyncio.Task[None]] = set()
        while True:
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            more, measured = self._issue(due)
            if not more:
                break
            task = asyncio.create_task(self._one(due, measured))
            running.add(task)
            task.add_done_callback(running.discard)
            due += rng.expovariate(self.plan.rate) if self.plan.arrivals == "poisson" else interval
        if running:
            await asyncio.gather(*running)

    async def _one(self, due: float, measured: bool) -> None:
        """Send one request; a measured one leaves a ``Sample``. Every await is bounded by the timeout."""
        self.live.on_sent()
        sent_s = due - self.measured_from
        payload = next(self._payloads)
        try:
            sample = await (self._generate(payload, due, sent_s) if self.plan.generative
                            else self._request(payload, due, sent_s))
        except (RequestTimeout, TooManyPending):
            sample = Sample(sent_s, "lost")
        except DeliveryFailed:
            sample = Sample(sent_s, "send_failed")
        self.live.on_done(time.monotonic(), sample.latency_ms)
        if measured:
            self.samples.append(sample)

    async def _request(self, payload: Any, due: float, sent_s: float) -> Sample:
        reply = await self.client.request_async(payload, timeout_s=self.plan.timeout_s)
        return Sample(sent_s, "ok" if reply.ok else "error", (reply.received_at - due) * 1000,
                      error_code=reply.error_code, queue_ms=reply.queue_ms, batch_size=reply.batch_size,
                      inference_ms=reply.inference_ms, service_ms=reply.service_ms)

    async def _generate(self, payload: Any, due: float, sent_s: float) -> Sample:
        """One streamed generation: the arrival time of each delta of the attempt that answers, and its final."""
        stream = await self.client.stream_async(payload, timeout_s=self.plan.timeout_s)
        arrivals: list[float] = []
        restarts = 0
        try:
            async for delta in stream:
                if delta.restart:
                    arrivals.clear()
                    restarts += 1
                arrivals.append(delta.received_at)
        except ReplyError as exc:
            return Sample(sent_s, "error", (exc.reply.received_at - due) * 1000, error_code=exc.code,
                          restarts=restarts)
        except StreamGap:
            return Sample(sent_s, "error", (time.monotonic() - due) * 1000, error_code="stream_gap",
                          restarts=restarts)
        completion = stream.completion or {}
        return Sample(sent_s, "ok", ((stream.completed_at or time.monotonic()) - due) * 1000,
                      first_chunk_ms=(arrivals[0] - due) * 1000 if arrivals else None,
                      chunk_gaps_ms=tuple(float(gap) * 1000 for gap in np.diff(arrivals)),
                      tokens=completion.get("usage", {}).get("completion_tokens"),
                      finish_reason=completion["choices"][0].get("finish_reason") if completion else None,
                      restarts=restarts)

    async def tick(self, view: ProgressView, label: str) -> None:
        while True:
            self.show(view, label)
            await asyncio.sleep(_TICK_S)

    def show(self, view: ProgressView, label: str) -> None:
        now = time.monotonic()
        warming = now < self.measured_from
        if self.plan.requests is not None:
            completed = float(len(self.samples))
        else:
            completed = min(max(0.0, now - self.measured_from), self.plan.duration_s or 0.0)
        view.update(self.live, now, completed, "warm-up" if warming else label)
