"""The load generator's figures: from per-request samples to the JSON report.

Public keys (docs and other tools rely on them): ``sent``, ``ok``, ``errors`` (code -> count),
``lost``, ``duplicates``, ``throughput_rps``, ``latency_ms`` (``p50``, ``p90``, ``p99``, ``p999``,
``max``); a sweep report holds them per step in ``runs``, each with its ``concurrency``. A generative run (``loadgen
--generative``) adds ``generation``: ``tokens``, ``tokens_per_s``, ``ttfc_ms`` (time to first chunk),
``between_chunks_ms``, ``finished``, ``aborted``, ``finish_reasons`` (reason -> count) and ``restarts``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

Outcome = Literal["ok", "error", "lost", "send_failed"]
PERCENTILES = {"p50": 50.0, "p90": 90.0, "p99": 99.0, "p999": 99.9}


@dataclass(frozen=True, slots=True)
class Sample:
    """One measured request."""

    sent_s: float
    """When it was sent (open loop: when it was due), in seconds since the measured phase began."""
    outcome: Outcome
    """``ok``/``error``: a reply came; ``lost``: none within the timeout; ``send_failed``: never sent."""
    latency_ms: float | None = None
    error_code: str | None = None
    queue_ms: float | None = None
    batch_size: int | None = None
    inference_ms: float | None = None
    service_ms: float | None = None
    first_chunk_ms: float | None = None
    """A generation: from sending (open loop: from when it was due) to its first delta."""
    chunk_gaps_ms: tuple[float, ...] = ()
    """A generation: the time between each delta and the next, of the attempt that answered."""
    tokens: int | None = None
    """A generation: the tokens it generated (the final's ``usage.completion_tokens``)."""
    finish_reason: str | None = None
    restarts: int = 0
    """A generation: how often it started over under a new attempt (its partition moved)."""

    @property
    def answered(self) -> bool:
        return self.latency_ms is not None

    @property
    def received_s(self) -> float | None:
        return None if self.latency_ms is None else self.sent_s + self.latency_ms / 1000


def percentiles(values: Iterable[float]) -> dict[str, float | None]:
    """Nearest-rank percentiles (the value below which the share lies, never an interpolation),
    plus ``max`` and ``mean``; all None for no values."""
    data = np.fromiter(values, dtype=float)
    if data.size == 0:
        return {**dict.fromkeys(PERCENTILES), "max": None, "mean": None}
    ranks = np.percentile(data, list(PERCENTILES.values()), method="inverted_cdf")
    figures = {name: round(float(value), 3) for name, value in zip(PERCENTILES, ranks, strict=True)}
    return {**figures, "max": round(float(data.max()), 3), "mean": round(float(data.mean()), 3)}


def build_report(samples: Sequence[Sample], *, duplicates: int = 0, late: int = 0,
                 settings: dict[str, Any] | None = None, generative: bool = False) -> dict[str, Any]:
    """The report of one run. ``throughput_rps`` counts replies (ok and error) per second from the
    start of the measured phase to the last reply; ``goodput_rps`` counts ok replies only. ``generative``: with
    ``generation_figures``."""
    answered = [sample for sample in samples if sample.answered]
    window_s = max((sample.received_s or 0.0 for sample in answered), default=0.0)
    ok = sum(sample.outcome == "ok" for sample in samples)
    return {
        **(settings or {}),
        "sent": len(samples),
        "ok": ok,
        "errors": dict(sorted(Counter(s.error_code or "unknown" for s in samples
                                      if s.outcome == "error").items())),
        "lost": sum(sample.outcome == "lost" for sample in samples),
        "send_failed": sum(sample.outcome == "send_failed" for sample in samples),
        "duplicates": duplicates,
        "late_replies": late,
        "window_s": round(window_s, 3),
        "throughput_rps": _rate(len(answered), window_s),
        "goodput_rps": _rate(ok, window_s),
        "latency_ms": percentiles(sample.latency_ms for sample in answered),  # type: ignore[misc]  # answered: each has one
        "server": server_figures(answered),
        **({"generation": generation_figures(samples, window_s)} if generative else {}),
    }


ABORTED = frozenset({"deadline", "cancelled"})
"""The finish reasons of a generation stopped before its end (kinference's own, beside OpenAI's stop and length)."""


def generation_figures(samples: Sequence[Sample], window_s: float) -> dict[str, Any]:
    """Tokens per second (every answered generation's tokens over the same window as ``throughput_rps``), time to
    first chunk and between chunks (nearest-rank percentiles over every gap of every request), and how the
    generations ended: ``finished`` (``stop`` or ``length``), ``aborted`` (``deadline`` or ``cancelled``)."""
    tokens = sum(sample.tokens or 0 for sample in samples)
    reasons = Counter(sample.finish_reason for sample in samples if sample.finish_reason is not None)
    return {
        "tokens": tokens,
        "tokens_per_s": _rate(tokens, window_s),
        "ttfc_ms": percentiles(s.first_chunk_ms for s in samples if s.first_chunk_ms is not None),
        "between_chunks_ms": percentiles(gap for sample in samples for gap in sample.chunk_gaps_ms),
        "finished": sum(n for reason, n in reasons.items() if reason not in ABORTED),
        "aborted": sum(n for reason, n in reasons.items() if reason in ABORTED),
        "finish_reasons": dict(sorted(reasons.items())),
        "restarts": sum(sample.restarts for sample in samples),
    }


def server_figures(answered: Sequence[Sample]) -> dict[str, Any]:
    """The service's own timings from the reply headers. The batch-size histogram counts requests
    (how many requests were served in a batch of each size), not batches."""
    sizes = Counter(sample.batch_size for sample in answered if sample.batch_size is not None)
    return {
        "queue_ms": percentiles(s.queue_ms for s in answered if s.queue_ms is not None),
        "inference_ms": percentiles(s.inference_ms for s in answered if s.inference_ms is not None),
        "service_ms": percentiles(s.service_ms for s in answered if s.service_ms is not None),
        "batch_size": {
            "mean": round(sum(size * n for size, n in sizes.items()) / sizes.total(), 3) if sizes else None,
            "histogram": {str(size): sizes[size] for size in sorted(sizes)},
        },
    }


def _rate(count: int, window_s: float) -> float:
    return round(count / window_s, 3) if window_s > 0 else 0.0
