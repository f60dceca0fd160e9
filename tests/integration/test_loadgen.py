"""``kinference loadgen`` and ``kinference demo`` against the real service (echo) on the test broker."""

from __future__ import annotations

import threading

import orjson
import pytest

from kinference.consumer.service import Service
from kinference.loadgen import cli, demo
from tests.integration.kafka_io import service_config

pytestmark = pytest.mark.integration

FIXED_KEYS = {"sent", "ok", "errors", "lost", "duplicates", "throughput_rps", "latency_ms"}
LATENCY_KEYS = {"p50", "p90", "p99", "p999", "max"}
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def target(broker):
    topics = broker.topics(requests=3, replies=2, dead=1)
    config = service_config(broker.bootstrap_servers, topics, max_batch_size=16, metrics=True, metrics_port=0)
    with Service(config) as service:
        assert service.wait_ready(30)
        yield ["--bootstrap-servers", broker.bootstrap_servers, "--request-topic", topics["requests"],
               "--reply-topic", topics["replies"], "--no-progress"]


def check_run(report: dict) -> None:
    assert set(report) >= FIXED_KEYS and set(report["latency_ms"]) >= LATENCY_KEYS
    assert report["ok"] == report["sent"] > 0
    assert (report["errors"], report["lost"], report["duplicates"]) == ({}, 0, 0)
    assert report["throughput_rps"] > 0 and 0 < report["latency_ms"]["p50"] <= report["latency_ms"]["max"]
    assert report["server"]["batch_size"]["mean"] >= 1


def test_closed_loop_run_writes_report_and_plot(target, tmp_path):
    payloads = tmp_path / "payloads.jsonl"
    payloads.write_text("\n".join(orjson.dumps({"text": f"t{i}"}).decode() for i in range(10)))
    out, plot = tmp_path / "run.json", tmp_path / "run.png"
    assert cli.main([*target, "--concurrency", "4", "--requests", "200", "--warmup", "0.3",
                     "--payloads", str(payloads), "--timeout", "5", "--out", str(out), "--plot", str(plot)]) == 0
    report = orjson.loads(out.read_bytes())
    check_run(report)
    assert report["sent"] == 200 and report["concurrency"] == 4
    assert plot.read_bytes().startswith(PNG)


def test_open_loop_run(target, tmp_path):
    out = tmp_path / "open.json"
    assert cli.main([*target, "--rate", "200", "--duration", "1", "--warmup", "0.2", "--arrivals", "constant",
                     "--out", str(out)]) == 0
    report = orjson.loads(out.read_bytes())
    check_run(report)
    assert report["sent"] == pytest.approx(200, abs=5) and report["mode"] == "open"


@pytest.mark.slow
def test_sweep_writes_runs_and_compares_with_an_earlier_sweep(target, tmp_path):
    first, second, plot = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "sweep.png"
    sweep = ["--sweep-concurrency", "1,4,16", "--duration", "0.5", "--warmup", "0.2"]
    assert cli.main([*target, *sweep, "--out", str(first), "--label", "first"]) == 0
    assert cli.main([*target, *sweep, "--out", str(second), "--plot", str(plot), "--label", "second",
                     "--compare", str(first)]) == 0
    report = orjson.loads(second.read_bytes())
    assert [run["concurrency"] for run in report["runs"]] == [1, 4, 16]
    for run in report["runs"]:
        check_run(run)
    assert plot.read_bytes().startswith(PNG)


def test_missing_topic_is_an_error_not_a_crash(broker):
    assert cli.main(["--bootstrap-servers", broker.bootstrap_servers, "--request-topic", "missing-q1",
                     "--reply-topic", "missing-r1", "--requests", "1", "--no-progress"]) == 1


@pytest.mark.slow
def test_demo_with_the_echo_handler(tmp_path):
    """The demo's wiring (own broker, topics, service, sweep, files), without loading a model."""
    assert demo.main(["--handler", "echo", "--sweep-concurrency", "1,8", "--duration", "0.5", "--warmup", "0.2",
                      "--output-dir", str(tmp_path), "--no-progress"]) == 0
    report = orjson.loads((tmp_path / "sweep.json").read_bytes())
    assert [run["concurrency"] for run in report["runs"]] == [1, 8]
    assert all(run["ok"] == run["sent"] > 0 for run in report["runs"])
    assert (tmp_path / "sweep.png").read_bytes().startswith(PNG)


def test_report_accounts_for_every_request_when_the_service_stops_mid_run(broker, tmp_path):
    """answered + errors + lost = sent, with error replies in the mix and the service gone half-way."""
    topics = broker.topics(requests=2, replies=1, dead=1)
    payloads = tmp_path / "mixed.jsonl"
    # Every fifth request is JSON null, which the RejectNull handler answers with bad_request.
    payloads.write_text("\n".join("null" if i % 5 == 0 else orjson.dumps({"i": i}).decode() for i in range(50)))
    config = service_config(broker.bootstrap_servers, topics, handler="tests.integration.slow_handler:RejectNull")
    out = tmp_path / "stopped.json"
    service = Service(config).start()
    try:
        assert service.wait_ready(30)
        stopper = threading.Timer(2.0, service.stop, kwargs={"grace_s": 0})
        stopper.start()
        code = cli.main(["--bootstrap-servers", broker.bootstrap_servers, "--request-topic", topics["requests"],
                         "--reply-topic", topics["replies"], "--no-progress", "--concurrency", "8",
                         "--duration", "4", "--warmup", "0", "--timeout", "1.5", "--payloads", str(payloads),
                         "--out", str(out)])
        stopper.join()
    finally:
        service.stop()
    report = orjson.loads(out.read_bytes())
    assert code == 0
    assert report["lost"] > 0, "requests sent after the service stopped must be reported lost"
    assert report["ok"] > 0 and report["errors"].get("bad_request", 0) > 0
    assert report["ok"] + sum(report["errors"].values()) + report["lost"] == report["sent"]
