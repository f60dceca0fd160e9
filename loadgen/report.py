"""The load generator's figures: from per-request samples to the JSON report.

Public keys (docs and other tools rely on them): ``sent``, ``ok``, ``errors`` (code -> count),
``lost``, ``duplicates``, ``throughput_rps``, ``latency_ms`` (``p50``, ``p90``, ``p99``, ``p999``,
``max``); a sweep report holds them per step in ``runs``, each with its ``concurrency``.
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
                 settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """The report of one run. ``throughput_rps`` counts replies (ok and error) per second from the
    start of the measured phase to the last reply; ``goodput_rps`` counts ok replies only."""
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
