"""``kinference bench image --quick`` end to end: its own broker, every scenario in a process of its own.

No timing is asserted: every scenario answered every request it sent, and every figure the targets use is there.
"""

from __future__ import annotations

import orjson
import pytest

from kinference.loadgen.bench import bench

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_quick_image_bench_answers_every_request_in_every_scenario(tmp_path):
    out, table = tmp_path / "image.json", tmp_path / "image.md"
    code = bench.main(["image", "--quick", "--duration", "1", "--warmup", "0.5", "--images", "8",
                       "--concurrency", "16", "--no-progress", "--out", str(out), "--markdown", str(table)])
    assert code == 0
    report = orjson.loads(out.read_bytes())
    assert [run["scenario"] for run in report["runs"]] == [
        "torchserve-static-b8", "kinference-default", "preprocess=1,micro=8", "preprocess=2", "preprocess=2,micro=8"]
    for run in report["runs"]:
        assert run["sent"] == run["ok"] > 0, run["scenario"]
        assert (run["lost"], run["errors"]) == (0, {}), run["scenario"]
        assert 0 < run["inference_busy"] <= 1, run["scenario"]
        assert run["machine_cpu_ms"] >= run["contender_cpu_ms"] > 0 and run["broker_cpu_ms"] > 0, run["scenario"]
    assert report["costs"]["decode_ms"] > 0 and report["costs"]["infer_ms"] > 0
    assert 0 < report["costs"]["cores_available"] <= report["machine"]["cpus"]
    assert [row["decode_threads"] for row in report["ceilings"]] == [1, 2]
    assert len(report["targets"]) == 2 and all(target["value"] > 0 for target in report["targets"])
    assert "Through Kafka at concurrency 16" in table.read_text()
