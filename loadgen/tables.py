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
    for name, value in rows:
        table.add_row(name, str(value))
    return table


def sweep_table(runs: Sequence[dict[str, Any]], title: str = "kinference concurrency sweep (latency in ms)") -> Table:
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for name in ("conc", "sent", "ok", "errors", "lost", "rps", "p50", "p90", "p99", "p99.9", "max", "batch"):
        table.add_column(name, justify="right", no_wrap=True)
    for run in runs:
        latency = run["latency_ms"]
        table.add_row(
            str(run["concurrency"]), str(run["sent"]), str(run["ok"]), str(sum(run["errors"].values())),
            str(run["lost"]), _number(run["throughput_rps"]),
            *(_number(latency[key]) for key in ("p50", "p90", "p99", "p999", "max")),
            _number(run["server"]["batch_size"]["mean"]),
        )
    return table


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
