"""Plots are written as PNG files, also for degenerate runs."""

from __future__ import annotations

import random
import re

from kinference.loadgen.plot import plot_run, plot_sweep, sweep_figure
from kinference.loadgen.report import Sample, build_report

PNG = b"\x89PNG\r\n\x1a\n"


def samples(n: int = 500) -> list[Sample]:
    rng = random.Random(0)
    outcomes = ["ok"] * 8 + ["error", "lost"]
    result = []
    for i in range(n):
        outcome = outcomes[i % len(outcomes)]
        latency = None if outcome == "lost" else rng.lognormvariate(2, 0.5)
        result.append(Sample(i / 100, outcome, latency, "bad_request" if outcome == "error" else None))
    return result


def test_run_plot_is_a_png(tmp_path):
    path = plot_run(samples(), tmp_path / "sub" / "run.png")
    assert path.read_bytes().startswith(PNG)


def test_run_plot_of_nothing_answered(tmp_path):
    assert plot_run([Sample(0.0, "lost")], tmp_path / "lost.png").read_bytes().startswith(PNG)
    assert plot_run([], tmp_path / "empty.png").read_bytes().startswith(PNG)


def test_sweep_plot_compares_several_sweeps(tmp_path):
    def sweep(scale: float) -> list[dict]:
        return [{**build_report(samples(50)), "concurrency": c, "throughput_rps": scale * c ** 0.5}
                for c in (1, 4, 16, 64)]

    path = plot_sweep([("batch 32", sweep(2.0)), ("batch 1", sweep(1.0))], tmp_path / "sweep.png")
    assert path.read_bytes().startswith(PNG)


def test_sweep_latency_axis_reads_plain_milliseconds():
    """Latencies within one decade (500-700 ms) get only minor ticks on the log axis: they read 600, not 6x10^2."""
    runs = [{**build_report(samples(10)), "concurrency": c, "latency_ms": {"p50": 500.0 + c, "p99": 640.0 + c}}
            for c in (1, 8, 32)]
    figure = sweep_figure([("one decade", runs)])
    figure.canvas.draw()
    latency = figure.axes[1]
    labels = [label.get_text() for minor in (False, True) for label in latency.get_yticklabels(minor=minor)]
    shown = [label for label in labels if label]
    assert shown, "the latency axis has labelled ticks"
    assert all(re.fullmatch(r"\d+(\.\d+)?", label) for label in shown), shown


def generations(n: int = 200) -> list[Sample]:
    rng = random.Random(1)
    return [Sample(i / 50, "ok", rng.uniform(200, 400), first_chunk_ms=rng.lognormvariate(3, 0.3),
                   chunk_gaps_ms=tuple(rng.uniform(5, 20) for _ in range(6)), tokens=32, finish_reason="length")
            for i in range(n)] + [Sample(4.1, "lost")]


def test_a_generative_run_plot_shows_time_to_first_chunk_and_between_chunks(tmp_path, monkeypatch):
    from kinference.loadgen import plot

    drawn = []
    original = plot._histogram
    monkeypatch.setattr(plot, "_histogram", lambda axes, values, measure, counted: (
        drawn.append((measure, len(values))), original(axes, values, measure, counted)))
    path = plot_run(generations(), tmp_path / "generative.png")
    assert path.read_bytes().startswith(PNG)
    assert drawn == [("time to first chunk", 200), ("time between chunks", 200 * 6)]


def test_a_generative_sweep_plots_tokens_per_second_and_chunk_times(tmp_path):
    from kinference.loadgen.plot import GENERATION_PANELS

    runs = [{**build_report(generations(20), generative=True), "concurrency": c} for c in (1, 8, 32)]
    figure = sweep_figure([("continuous batching", runs)], panels=GENERATION_PANELS)
    assert [axes.get_title() for axes in figure.axes] == [panel.title for panel in GENERATION_PANELS]
    tokens = figure.axes[0].get_lines()[0].get_ydata()
    assert list(tokens) == [run["generation"]["tokens_per_s"] for run in runs]
    assert plot_sweep([("continuous batching", runs)], tmp_path / "sweep.png").read_bytes().startswith(PNG)
