"""``kinference bench gpu`` end to end on a CPU, small: a tiny BERT built from its config alone, its ceilings,
``kinference serve`` drained as a user runs it at its defaults, at 1 and 2 workers and with one named contender,
and the relay beside them, on the embedded broker.

No speed is asserted: every drain answered its whole backlog, and every figure the tables show is there.
"""

from __future__ import annotations

import orjson
import pytest
import torch
from transformers import BertConfig

from kinference.loadgen.bench import bench

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.model]


@pytest.mark.timeout(900)
def test_a_small_gpu_bench_on_a_cpu_drains_every_contender(tmp_path):
    BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64).save_pretrained(
        tmp_path / "tiny")
    out, table = tmp_path / "gpu.json", tmp_path / "gpu.md"
    code = bench.main(["gpu", "--models", str(tmp_path / "tiny"), "--workers", "1,2", "--requests", "1500",
                       "--drain-seconds", "300", "--ceiling-seconds", "0.3", "--ceiling-batch", "64",
                       "--handler-batch-sizes", "8", "--partitions", "2", "--contender", "small=--max-batch-size 8",
                       "--reference", "relay", "--reference-requests", "2000", "--out", str(out),
                       "--markdown", str(table)])
    assert code == 0
    report = orjson.loads(out.read_bytes())
    (model,) = report["models"]
    assert model["model"] == "tiny" and model["random_init"] and model["requests"] == 1500
    assert [(row["dtype"], row["batch_size"]) for row in model["plain_ceilings"]] == [("float32", 64)]
    assert [(row["dtype"], row["batch_size"]) for row in model["handler_ceilings"]] == [("float32", 8)]
    assert all(row["items_per_s"] > 0 for row in model["plain_ceilings"] + model["handler_ceilings"])
    assert [row["contender"] for row in model["drains"]] == ["defaults", "workers=1", "workers=2", "small"]
    assert model["drains"][2]["flags"] == ["--workers", "2", "--max-batch-size", "256"]
    for row in model["drains"]:
        assert row["complete"] and row["answered"] == 1500, row["contender"]
        assert row["msgs_per_s"] > 0 and row["cpu_cores"] > 0 and row["cpu_us_per_msg"] > 0, row["contender"]
        assert row["gpu_busy"] is None or torch.cuda.is_available(), row["contender"]
    (relay,) = report["reference"]
    assert relay["contender"] == "relay" and relay["requests"] == 2000 and relay["msgs_per_s"] > 0
    markdown = table.read_text()
    assert "**Drains of kinference serve on cpu" in markdown
    assert "| tiny | workers=2 | 1,500 |" in markdown and "| workers=2 | --workers 2 --max-batch-size 256 |" in markdown
