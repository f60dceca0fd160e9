"""The reports as rich tables for the terminal."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich import box
from rich.table import Table


def run_table(report: dict[str, Any], title: str = "kinference loadgen") -> Table:
    table = Table(title=title, show_header=False, title_justify="left", box=box.SIMPLE)
    table.add_column(style="bold")
    table.add_column(justify="right")
    latency, server = report["latency_ms"], report["server"]
    rows = [
        ("sent", report["sent"]),
        ("ok", report["ok"]),
        ("error replies", _counts(report["errors"]) or "0"),
        ("lost (no reply in time)", report["lost"]),
        ("send failed", report["send_failed"]),
        ("duplicates / late replies", f"{report['duplicates']} / {report['late_replies']}"),
        ("throughput", f"{report['throughput_rps']:.1f} replies/s"),
        ("latency p50 / p90 / p99", _ms(latency, "p50", "p90", "p99")),
        ("latency p99.9 / max", _ms(latency, "p999", "max")),
        ("server queue p50 / p99", _ms(server["queue_ms"], "p50", "p99")),
        ("server inference p50 / p99", _ms(server["inference_ms"], "p50", "p99")),
        ("server total p50 / p99", _ms(server["service_ms"], "p50", "p99")),
        ("batch size mean / max", f"{_number(server['batch_size']['mean'])} / {_largest(server['batch_size'])}"),
    ]
    generation = report.get("generation")
    if generation:
        rows[-4:] = [  # a generation has no batch: the server's queue and inference figures do not apply
            ("finished / aborted", f"{generation['finished']} / {generation['aborted']}"),
            ("finish reasons", _counts(generation["finish_reasons"]) or "-"),
            ("restarts (new attempts)", generation["restarts"]),
            ("tokens", f"{generation['tokens']} ({generation['tokens_per_s']:.1f} tokens/s)"),
            ("first chunk p50 / p90 / p99", _ms(generation["ttfc_ms"], "p50", "p90", "p99")),
            ("between chunks p50 / p90 / p99", _ms(generation["between_chunks_ms"], "p50", "p90", "p99")),
        ]
    for name, value in rows:
        table.add_row(name, str(value))
    return table


def sweep_table(runs: Sequence[dict[str, Any]], title: str = "kinference concurrency sweep (latency in ms)") -> Table:
    """One row per run; generative runs (with ``generation``) show aborted generations, tokens/s, time to first chunk
    and between chunks, and the whole generation's p50 where batch runs show replies/s, the latency tail and the
    batch size."""
    generative = any("generation" in run for run in runs)
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    figures = (("aborted", "tok/s", "ttfc p50", "ttfc p99", "gap p50", "gap p99", "p50") if generative else
               ("rps", "p50", "p90", "p99", "p99.9", "max", "batch"))
    for name in ("conc", "sent", "ok", "errors", "lost", *figures):
        table.add_column(name, justify="right", no_wrap=True)
    for run in runs:
        table.add_row(str(run["concurrency"]), str(run["sent"]), str(run["ok"]), str(sum(run["errors"].values())),
                      str(run["lost"]), *(_generation_cells(run) if generative else _reply_cells(run)))
    return table


def _reply_cells(run: dict[str, Any]) -> tuple[str, ...]:
    latency = run["latency_ms"]
    return (_number(run["throughput_rps"]), *(_number(latency[key]) for key in ("p50", "p90", "p99", "p999", "max")),
            _number(run["server"]["batch_size"]["mean"]))


def _generation_cells(run: dict[str, Any]) -> tuple[str, ...]:
    generation = run["generation"]
    ttfc, gaps = generation["ttfc_ms"], generation["between_chunks_ms"]
    return (str(generation["aborted"]), _number(generation["tokens_per_s"]), _number(ttfc["p50"]),
            _number(ttfc["p99"]), _number(gaps["p50"]), _number(gaps["p99"]), _number(run["latency_ms"]["p50"]))


def _ms(figures: dict[str, float | None], *keys: str) -> str:
    return " / ".join(_number(figures[key]) for key in keys) + " ms"


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if abs(value) < 100 else f"{value:.0f}"


def _largest(batch_size: dict[str, Any]) -> str:
    return max(batch_size["histogram"], key=int, default="-")


def _counts(counts: dict[str, int]) -> str:
    return "  ".join(f"{key}:{count}" for key, count in counts.items())
