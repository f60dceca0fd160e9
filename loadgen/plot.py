"""PNG figures with matplotlib's object API (no pyplot: no global state, no GUI backend)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import LogFormatter

from kinference.loadgen.report import Sample, percentiles


def plot_run(samples: Sequence[Sample], path: Path, title: str = "kinference loadgen") -> Path:
    """Latency of each request against when it was sent, and the latency histogram; for generations (samples with a
    first chunk) the time to first chunk over time, its histogram and the histogram of the times between chunks."""
    generative = any(s.first_chunk_ms is not None for s in samples)
    figure = Figure(figsize=(16 if generative else 12, 4.5), layout="constrained")
    over_time, *histograms = figure.subplots(1, 3 if generative else 2,
                                             width_ratios=(3, 2, 2) if generative else (3, 2))
    measure = "time to first chunk" if generative else "latency"
    answered = [s for s in samples if s.answered]
    shown = {id(s): s.first_chunk_ms if generative else s.latency_ms for s in answered}
    for outcome, color, marker in (("ok", "tab:blue", "."), ("error", "tab:orange", "x")):
        chosen = [s for s in answered if s.outcome == outcome and shown[id(s)] is not None]
        if chosen:
            over_time.scatter([s.sent_s for s in chosen], [shown[id(s)] for s in chosen], s=6, c=color,
                              marker=marker, label=f"{outcome} ({len(chosen)})", linewidths=0.8)
    lost = [s.sent_s for s in samples if s.outcome == "lost"]
    if lost:  # no latency to show: marked along the top edge
        over_time.scatter(lost, [0.98] * len(lost), c="tab:red", marker="v", s=14, label=f"lost ({len(lost)})",
                          transform=over_time.get_xaxis_transform())
    over_time.set(xlabel="time sent (s since warm-up ended)", ylabel=f"{measure} (ms)",
                  title=f"{measure.capitalize()} over time")
    if samples:
        over_time.legend(loc="upper left")
    over_time.grid(alpha=0.3)
    _histogram(histograms[0], [v for v in shown.values() if v is not None], measure, "requests")
    if generative:
        _histogram(histograms[1], [gap for s in answered for gap in s.chunk_gaps_ms], "time between chunks",
                   "chunks")
    figure.suptitle(title)
    return _save(figure, path)


def _histogram(axes: Axes, values: Sequence[float], measure: str, counted: str) -> None:
    """``values`` (ms) in 60 bins, with their p50 and p99 marked."""
    if values:
        axes.hist(values, bins=60, color="tab:blue", alpha=0.8)
        figures = percentiles(values)
        for name, style in (("p50", "--"), ("p99", ":")):
            value = figures[name]
            assert value is not None  # values is not empty
            axes.axvline(value, color="black", linestyle=style, label=f"{name} {value:.1f} ms")
        axes.legend()
    axes.set(xlabel=f"{measure} (ms)", ylabel=counted, title=f"{measure.capitalize()} histogram")
    axes.grid(alpha=0.3)


Series = Sequence[tuple[str, Sequence[dict[str, Any]]]]
"""(label, runs of a sweep report) per line of a sweep plot."""


@dataclass(frozen=True)
class Panel:
    """One panel of a sweep plot: a figure of each run against concurrency; ``tail`` draws its p50 (dashed) and
    p99 from a percentiles dict, else the one number."""

    title: str
    ylabel: str
    value: Callable[[dict[str, Any]], Any]
    tail: bool = False


REPLY_PANELS = (Panel("Throughput", "replies / s", lambda run: run["throughput_rps"]),
                Panel("Latency p50 (dashed) and p99", "latency (ms)", lambda run: run["latency_ms"], tail=True))
GENERATION_PANELS = (
    Panel("Tokens per second", "tokens / s", lambda run: run["generation"]["tokens_per_s"]),
    Panel("Time to first chunk p50 (dashed) and p99", "time to first chunk (ms)",
          lambda run: run["generation"]["ttfc_ms"], tail=True),
    Panel("Time between chunks p50 (dashed) and p99", "time between chunks (ms)",
          lambda run: run["generation"]["between_chunks_ms"], tail=True),
)


def plot_sweep(series: Series, path: Path, title: str = "kinference concurrency sweep") -> Path:
    """Throughput and p50/p99 latency against concurrency (for generative runs: tokens per second, time to first
    chunk and time between chunks); one line (one colour) per sweep, so several configurations (``label``, ``runs``
    of a sweep report) compare on one figure."""
    generative = any("generation" in run for _, runs in series for run in runs)
    return _save(sweep_figure(series, title, GENERATION_PANELS if generative else REPLY_PANELS), path)


def sweep_figure(series: Series, title: str = "kinference concurrency sweep",
                 panels: Sequence[Panel] = REPLY_PANELS) -> Figure:
    """``plot_sweep``'s figure: one panel of ``panels`` beside the other."""
    figure = Figure(figsize=(6 * len(panels), 4.5), layout="constrained")
    axes_of = figure.subplots(1, len(panels), squeeze=False)[0]
    concurrencies = sorted({run["concurrency"] for _, runs in series for run in runs if run.get("concurrency")})
    for axes, panel in zip(axes_of, panels, strict=True):
        for index, (label, runs) in enumerate(series):
            color = f"C{index % 10}"
            steps = sorted((run for run in runs if run.get("concurrency")), key=lambda run: run["concurrency"])
            x = [run["concurrency"] for run in steps]
            if not panel.tail:
                axes.plot(x, [panel.value(run) for run in steps], marker="o", color=color, label=label)
                continue
            for key, style in (("p50", "--"), ("p99", "-")):
                axes.plot(x, [panel.value(run)[key] for run in steps], marker="o", linestyle=style, color=color,
                          label=f"{label} {key}")
        if panel.tail:
            axes.set_yscale("log")  # queueing makes latency span orders of magnitude across a sweep
            # Milliseconds as plain numbers (600, not 6x10^2): a sweep within one decade shows only minor ticks,
            # which the log scale's own formatter writes in scientific notation. Which ticks get a label stays the
            # log scale's choice.
            axes.yaxis.set_major_formatter(_PlainLogFormatter())
            axes.yaxis.set_minor_formatter(_PlainLogFormatter(labelOnlyBase=False))
        axes.set_xscale("log", base=2)
        axes.set_xticks(concurrencies, [str(c) for c in concurrencies])
        axes.set(xlabel="concurrency (requests in flight)", ylabel=panel.ylabel, title=panel.title)
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
