"""``kinference cpu-paths``: the embedding handler's CPU options measured side by side."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from kinference.loadgen.bench import cpu_paths


@pytest.mark.model
def test_a_small_run_reports_speed_and_accuracy_of_each_variant(tmp_path: Path) -> None:
    out, table = tmp_path / "cpu.json", tmp_path / "cpu.md"
    assert cpu_paths.main(["--texts", "16", "--rounds", "2", "--variants", "torch,onnxruntime",
                           "--out", str(out), "--markdown", str(table)]) == 0
    report = orjson.loads(out.read_bytes())
    rows = {row["variant"]: row for row in report["variants"]}
    assert set(rows) == {"torch", "onnxruntime"}
    assert rows["torch"]["ratio_to_torch"] == 1.0 and rows["torch"]["cosine_min"] == pytest.approx(1.0)
    assert rows["onnxruntime"]["cosine_min"] > 0.9999  # the same float32 model, another engine
    assert all(len(row["rounds"]) == 2 and row["items_per_s"] > 0 for row in rows.values())
    assert "| onnxruntime | `runtime=onnxruntime` |" in table.read_text()


def test_unknown_variants_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cpu_paths.main(["--variants", "torch,tensorrt"])
    assert exit_info.value.code == 2
    assert "unknown variant(s) tensorrt" in capsys.readouterr().err
