"""The report math on synthetic samples: percentiles, counts, throughput, server figures."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kinference.loadgen.report import Sample, build_report, percentiles

FIXED_KEYS = {"sent", "ok", "errors", "lost", "duplicates", "throughput_rps", "latency_ms"}


def test_nearest_rank_percentiles_of_1_to_100():
    figures = percentiles(range(1, 101))
    assert figures == {"p50": 50, "p90": 90, "p99": 99, "p999": 100, "max": 100, "mean": 50.5}


def test_percentiles_of_nothing_are_none():
    assert set(percentiles([]).values()) == {None}


@given(st.lists(st.floats(min_value=0, max_value=1e6, allow_nan=False), min_size=1, max_size=300))
def test_percentiles_are_ordered_observed_values(values):
    figures = percentiles(values)
    ordered = [figures[k] for k in ("p50", "p90", "p99", "p999", "max")]
    assert ordered == sorted(ordered)
    rounded = {round(v, 3) for v in values}
    assert all(any(math.isclose(f, v, abs_tol=1e-3) for v in rounded) for f in ordered)
    assert figures["max"] == round(max(values), 3)


def test_counts_outcomes_errors_by_code_and_duplicates():
    samples = (
        [Sample(i * 0.01, "ok", 10.0 + i, batch_size=4, queue_ms=1.0, inference_ms=5.0, service_ms=7.0)
         for i in range(90)]
        + [Sample(1.0, "error", 3.0, error_code="bad_request")] * 4
        + [Sample(1.0, "error", 3.0, error_code="deadline_exceeded")] * 2
        + [Sample(1.1, "lost")] * 3
        + [Sample(1.2, "send_failed")]
    )
    report = build_report(samples, duplicates=2, late=1, settings={"concurrency": 8})
    assert set(report) >= FIXED_KEYS
    assert report["concurrency"] == 8
    assert (report["sent"], report["ok"], report["lost"], report["send_failed"]) == (100, 90, 3, 1)
    assert report["errors"] == {"bad_request": 4, "deadline_exceeded": 2}
    assert (report["duplicates"], report["late_replies"]) == (2, 1)
    assert set(report["latency_ms"]) >= {"p50", "p90", "p99", "p999", "max"}
    assert report["latency_ms"]["max"] == 99.0
    # The last reply: an error reply sent at 1.0 s and answered 3 ms later.
    assert report["window_s"] == pytest.approx(1.003)
    assert report["throughput_rps"] == pytest.approx(96 / 1.003, rel=1e-3)
    assert report["goodput_rps"] == pytest.approx(90 / 1.003, rel=1e-3)
    server = report["server"]
    assert server["batch_size"] == {"mean": 4.0, "histogram": {"4": 90}}
    assert server["queue_ms"]["p50"] == 1.0 and server["inference_ms"]["max"] == 5.0


def test_batch_histogram_counts_requests_per_batch_size():
    samples = [Sample(0, "ok", 1.0, batch_size=size) for size in (1, 2, 2, 32, 32, 32, 32)]
    assert build_report(samples)["server"]["batch_size"] == {"mean": 19.0, "histogram": {"1": 1, "2": 2,
                                                                                        "32": 4}}


def test_empty_and_all_lost_runs_report_zero_throughput():
    assert build_report([])["throughput_rps"] == 0.0
    report = build_report([Sample(0, "lost")] * 5)
    assert (report["sent"], report["lost"], report["throughput_rps"]) == (5, 5, 0.0)
    assert report["latency_ms"]["p99"] is None


def test_generation_figures_count_tokens_chunks_and_how_generations_ended():
    samples = [Sample(0.0, "ok", 100.0, first_chunk_ms=10.0, chunk_gaps_ms=(5.0, 7.0), tokens=8,
                      finish_reason="length"),
               Sample(0.1, "ok", 60.0, first_chunk_ms=30.0, chunk_gaps_ms=(9.0,), tokens=3, finish_reason="stop",
                      restarts=1),
               Sample(0.2, "ok", 150.0, first_chunk_ms=20.0, tokens=2, finish_reason="deadline"),
               Sample(0.3, "error", 5.0, error_code="handler_error"),
               Sample(0.4, "lost")]
    report = build_report(samples, generative=True)
    generation = report["generation"]
    assert report["window_s"] == 0.35  # the last reply: sent at 0.2 s, 150 ms long
    assert generation["tokens"] == 13 and generation["tokens_per_s"] == round(13 / 0.35, 3)
    assert (generation["ttfc_ms"]["p50"], generation["ttfc_ms"]["max"]) == (20.0, 30.0)
    assert (generation["between_chunks_ms"]["p50"], generation["between_chunks_ms"]["max"]) == (7.0, 9.0)
    assert (generation["finished"], generation["aborted"], generation["restarts"]) == (2, 1, 1)
    assert generation["finish_reasons"] == {"deadline": 1, "length": 1, "stop": 1}
    assert "generation" not in build_report(samples), "a batch run's report keeps its keys"


def test_generation_figures_of_nothing_answered():
    generation = build_report([Sample(0.0, "lost")], generative=True)["generation"]
    assert (generation["tokens"], generation["tokens_per_s"], generation["finished"]) == (0, 0.0, 0)
    assert generation["ttfc_ms"]["p50"] is None and generation["between_chunks_ms"]["p50"] is None


def test_tables_show_the_generation_figures():
    from rich.console import Console

    from kinference.loadgen.tables import run_table, sweep_table

    samples = [Sample(0.0, "ok", 100.0, first_chunk_ms=12.5, chunk_gaps_ms=(5.0,), tokens=8, finish_reason="length"),
               Sample(0.1, "ok", 90.0, first_chunk_ms=14.0, tokens=8, finish_reason="cancelled")]
    report = {**build_report(samples, generative=True), "concurrency": 2}
    console = Console(width=200, record=True)
    console.print(run_table(report))
    console.print(sweep_table([report]))
    text = console.export_text()
    for shown in ("finished / aborted", "1 / 1", "cancelled:1  length:1", "16 (", "tokens/s",
                  "first chunk p50 / p90 / p99", "12.5 / 14.0 / 14.0 ms", "between chunks", "ttfc p50", "gap p99"):
        assert shown in text, shown
    assert "batch size" not in text, "a generation has no batch"
