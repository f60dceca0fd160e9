"""``kinference drain`` end to end, small: every contender drains its backlog on the embedded broker, and on
Apache Kafka when ``--broker kafka`` asks for it."""

from __future__ import annotations

import orjson
import pytest

from kinference.consumer.brokers.apache_kafka import broker_jars
from kinference.errors import BrokerError
from kinference.loadgen.bench import drain

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(600)
def test_a_small_drain_of_every_single_process_contender(tmp_path):
    out = tmp_path / "drain.json"
    assert drain.main(["--requests", "2000", "--embedding-requests", "200", "--sim-capacities", "1",
                       "--sim-inference-threads", "1",
                       "--contenders", "relay,kinference-echo,kinference-sim,kinference-embedding",
                       "--out", str(out), "--markdown", str(tmp_path / "drain.md"),
                       "--profiles", str(tmp_path / "profiles")]) == 0
    report = orjson.loads(out.read_bytes())
    rows = {row["contender"]: row for row in report["drains"]}
    assert set(rows) == {"relay", "kinference-echo", "kinference-sim", "kinference-sim@1x-echo",
                         "kinference-embedding"}
    for name, row in rows.items():
        # /proc counts CPU in clock ticks (10 ms): the relay's 2,000 messages take about one, so it may read 0.
        assert row["msgs_per_s"] > 0 and (row["cpu_us_per_msg"] > 0 or name == "relay")
        assert row["broker_cpu_us_per_msg"] >= 0
    assert 0 < rows["kinference-sim"]["device_busy"] <= 1 and rows["kinference-sim"]["extra"]["device_capacity_per_s"]
    assert report["embedding_ceiling"]["best_items_per_s"] > 0
    assert {target["target"] for target in report["targets"]} == {
        "echo drain >= 0.5 x relay drain", "echo contender <= 5 x the relay's CPU per message",
        "sim contender <= 10 x the relay's CPU per message",
        "simulated GPU >= 90% busy at every capacity up to the echo drain rate (inference=1)",
        "embedding drain >= 0.9 x in-process length-grouped ceiling"}
    profiled = rows["kinference-echo"]["profile"]
    # py-spy needs ptrace rights; where it has them, the echo drain shows the poll thread at work.
    assert "us_per_msg" in profiled or "py-spy" in profiled.get("note", "")
    # A row per contender in the drain table, and in the per-stage table once profiled.
    assert (tmp_path / "drain.md").read_text().count("\n| kinference-") == (8 if "us_per_msg" in profiled else 4)
    assert report["broker"]["kind"] == "tansu" and "Broker: Tansu" in (tmp_path / "drain.md").read_text()


@pytest.mark.timeout(300)
def test_a_drain_on_apache_kafka_names_its_broker(tmp_path):
    try:
        broker_jars()
    except BrokerError as exc:
        pytest.skip(str(exc))
    out = tmp_path / "drain.json"
    assert drain.main(["--broker", "kafka", "--contenders", "relay,kinference-echo", "--requests", "2000",
                       "--no-profile", "--out", str(out), "--markdown", str(tmp_path / "drain.md")]) == 0
    report = orjson.loads(out.read_bytes())
    assert report["broker"]["kind"] == "kafka" and report["broker"]["description"].startswith("Apache Kafka 4.")
    assert [row["contender"] for row in report["drains"]] == ["relay", "kinference-echo"]
    assert all(row["msgs_per_s"] > 0 for row in report["drains"])
    assert (tmp_path / "drain.md").read_text().startswith("Broker: Apache Kafka 4.")


@pytest.mark.timeout(300)
def test_the_traced_echo_contender_drains_with_tracing_on_when_named(tmp_path):
    out = tmp_path / "drain.json"
    assert drain.main(["--contenders", "kinference-echo-traced", "--requests", "1000", "--no-profile",
                       "--out", str(out)]) == 0
    (row,) = orjson.loads(out.read_bytes())["drains"]
    assert row["contender"] == "kinference-echo-traced" and row["msgs_per_s"] > 0
    assert "kinference-echo-traced" not in drain.DrainOptions().contenders  # opt in: not in a default run


@pytest.mark.timeout(300)
def test_the_two_worker_contenders_drain_with_one_shared_simulated_device(tmp_path):
    """``serve --workers 2``: the contenders' CPU is the supervisor's and its workers', and the sim's device busy
    time is both workers' on one device."""
    out = tmp_path / "drain.json"
    assert drain.main(["--contenders", "kinference-echo-2-workers,kinference-sim-2-workers", "--requests", "8000",
                       "--no-profile", "--out", str(out)]) == 0
    rows = {row["contender"]: row for row in orjson.loads(out.read_bytes())["drains"]}
    assert set(rows) == {"kinference-echo-2-workers", "kinference-sim-2-workers"}
    for row in rows.values():
        assert row["msgs_per_s"] > 0 and row["cpu_us_per_msg"] > 0 and row["broker_cpu_us_per_msg"] >= 0
    assert 0 < rows["kinference-sim-2-workers"]["device_busy"] <= 1
    assert "device_busy" not in rows["kinference-echo-2-workers"]


@pytest.mark.timeout(300)
def test_a_device_process_contender_drains_with_its_device_busy_time(tmp_path):
    """``serve --device-process on``: a supervisor, the device process (the simulated GPU lives there, in the host's
    device file) and one worker; the contender's CPU is all three's."""
    out = tmp_path / "drain.json"
    assert drain.main(["--contenders", "kinference-sim-device-1-worker", "--requests", "4000", "--no-profile",
                       "--out", str(out)]) == 0
    (row,) = orjson.loads(out.read_bytes())["drains"]
    assert row["contender"] == "kinference-sim-device-1-worker"
    assert row["msgs_per_s"] > 0 and row["cpu_us_per_msg"] > 0 and 0 < row["device_busy"] <= 1
