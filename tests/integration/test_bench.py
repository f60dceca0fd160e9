"""``kinfer bench`` end to end, tiny: its own broker, the transport scenarios and one model scenario.

No timing is asserted: only that every scenario x concurrency row is there, fully answered, and that
the plot and the Markdown tables are written.
"""

from __future__ import annotations

import orjson
import pytest

from consumer.config import ServiceConfig
from loadgen import bench

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.model]

PNG = b"\x89PNG\r\n\x1a\n"
KAFKA_SCENARIOS = ["relay", "kinfer-echo", "kinfer-greedy"]


def test_quick_bench_writes_every_row_and_the_plot(tmp_path):
    out, plot, table = tmp_path / "bench.json", tmp_path / "bench.png", tmp_path / "bench.md"
    code = bench.main(["--quick", "--corpus", "short", "--concurrency", "1,4", "--duration", "1",
                       "--warmup", "0.5", "--ceiling-batch-sizes", "1,4", "--no-progress",
                       "--scenarios", ",".join(["inproc-fifo", *KAFKA_SCENARIOS]),
                       "--out", str(out), "--plot", str(plot), "--markdown", str(table)])
    assert code == 0
    report = orjson.loads(out.read_bytes())

    rows = {(run["scenario"], run["corpus"], run["concurrency"]): run for run in report["runs"]}
    assert set(rows) == {(name, "short", c) for name in KAFKA_SCENARIOS for c in (1, 4)}
    for run in rows.values():
        assert run["sent"] == run["ok"] > 0, run["scenario"]
        assert (run["lost"], run["errors"]) == (0, {})
        assert run["steady_rps"] > 0

    (ceiling,) = report["ceilings"]
    assert ceiling["scenario"] == "inproc-fifo" and set(ceiling["items_per_s"]) == {"1", "4"}
    assert ceiling["batch1_latency_ms"]["p50"] > 0
    # Only the targets whose scenarios ran are judged; each says whether it is met.
    assert {t["target"] for t in report["targets"]} >= {"echo handler >= 0.5x the relay"}
    assert all(isinstance(t["met"], bool) for t in report["targets"])
    assert report["machine"]["cpus"] >= 1 and report["command"].startswith("kinfer bench --quick")

    assert plot.read_bytes().startswith(PNG)
    assert "| kinfer-greedy |" in table.read_text()


def test_kinfer_settings_are_data():
    """Each kinfer setting is a scenario; its overrides are valid ServiceConfig fields."""
    kinfer = [s.name for s in bench.SCENARIOS if s.kind == "kinfer"]
    assert kinfer == [setting.name for setting in bench.KINFER_SETTINGS]
    assert bench.DEFAULT_SETTING in kinfer
    for setting in bench.KINFER_SETTINGS:
        ServiceConfig(**setting.overrides)


def test_unknown_scenario_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--scenarios", "relay,nope"])
    assert exit_info.value.code == 2
    assert "nope" in capsys.readouterr().err
