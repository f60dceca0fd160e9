"""PNG figures with matplotlib's object API (no pyplot: no global state, no GUI backend)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import LogFormatter

from kinference.loadgen.report import Sample, percentiles


def plot_run(samples: Sequence[Sample], path: Path, title: str = "kinference loadgen") -> Path:
    """Latency of each request against when it was sent, and the latency histogram."""
    figure = Figure(figsize=(12, 4.5), layout="constrained")
    over_time, histogram = figure.subplots(1, 2, width_ratios=(3, 2))
    answered = [s for s in samples if s.answered]
    for outcome, color, marker in (("ok", "tab:blue", "."), ("error", "tab:orange", "x")):
        chosen = [s for s in answered if s.outcome == outcome]
        if chosen:
            over_time.scatter([s.sent_s for s in chosen], [s.latency_ms for s in chosen], s=6, c=color,
                              marker=marker, label=f"{outcome} ({len(chosen)})", linewidths=0.8)
    lost = [s.sent_s for s in samples if s.outcome == "lost"]
    if lost:  # no latency to show: marked along the top edge
        over_time.scatter(lost, [0.98] * len(lost), c="tab:red", marker="v", s=14, label=f"lost ({len(lost)})",
                          transform=over_time.get_xaxis_transform())
    over_time.set(xlabel="time sent (s since warm-up ended)", ylabel="latency (ms)", title="Latency over time")
    if samples:
        over_time.legend(loc="upper left")
    over_time.grid(alpha=0.3)

    latencies = [s.latency_ms for s in answered]
    if latencies:
        histogram.hist(latencies, bins=60, color="tab:blue", alpha=0.8)
        figures = percentiles(latencies)
        for name, style in (("p50", "--"), ("p99", ":")):
            value = figures[name]
            histogram.axvline(value, color="black", linestyle=style, label=f"{name} {value:.1f} ms")
        histogram.legend()
    histogram.set(xlabel="latency (ms)", ylabel="requests", title="Latency histogram")
    histogram.grid(alpha=0.3)
    figure.suptitle(title)
    return _save(figure, path)


def plot_sweep(series: Sequence[tuple[str, Sequence[dict[str, Any]]]], path: Path,
               title: str = "kinference concurrency sweep") -> Path:
    """Throughput and p50/p99 latency against concurrency; one line (one colour) per sweep, so
    several configurations (``label``, ``runs`` of a sweep report) compare on one figure."""
    return _save(sweep_figure(series, title), path)


def sweep_figure(series: Sequence[tuple[str, Sequence[dict[str, Any]]]],
                 title: str = "kinference concurrency sweep") -> Figure:
    """``plot_sweep``'s figure."""
    figure = Figure(figsize=(12, 4.5), layout="constrained")
    throughput, latency = figure.subplots(1, 2)
    for index, (label, runs) in enumerate(series):
        color = f"C{index % 10}"
        steps = sorted((run for run in runs if run.get("concurrency")), key=lambda run: run["concurrency"])
        x = [run["concurrency"] for run in steps]
        throughput.plot(x, [run["throughput_rps"] for run in steps], marker="o", color=color, label=label)
        for key, style in (("p50", "--"), ("p99", "-")):
            latency.plot(x, [run["latency_ms"][key] for run in steps], marker="o", linestyle=style,
                         color=color, label=f"{label} {key}")
    concurrencies = sorted({run["concurrency"] for _, runs in series for run in runs if run.get("concurrency")})
    latency.set_yscale("log")  # queueing makes latency span orders of magnitude across a sweep
    # Milliseconds as plain numbers (600, not 6x10^2): a sweep within one decade shows only minor ticks, which the
    # log scale's own formatter writes in scientific notation. Which ticks get a label stays the log scale's choice.
    latency.yaxis.set_major_formatter(_PlainLogFormatter())
    latency.yaxis.set_minor_formatter(_PlainLogFormatter(labelOnlyBase=False))
    for axes, ylabel, name in ((throughput, "replies / s", "Throughput"),
                               (latency, "latency (ms)", "Latency p50 (dashed) and p99")):
        axes.set_xscale("log", base=2)
        axes.set_xticks(concurrencies, [str(c) for c in concurrencies])
        axes.set(xlabel="concurrency (requests in flight)", ylabel=ylabel, title=name)
        axes.grid(alpha=0.3, which="both")
        axes.legend()
    figure.suptitle(title)
    return figure


def _save(figure: Figure, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return path


class _PlainLogFormatter(LogFormatter):
    """The log scale's choice of which ticks to label, each label a plain number (matplotlib 3.8's own writes a
    minor tick past 10,000 as 2e+04)."""

    def __call__(self, x: float, pos: int | None = None) -> str:
        return f"{x:.10g}" if super().__call__(x, pos) else ""
