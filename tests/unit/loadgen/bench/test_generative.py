"""``kinference bench generate``'s pieces without a model: the closed loop, the figures, the targets, the tables and
the plot."""

from __future__ import annotations

import threading
import time

from kinference.loadgen.bench import generative
from kinference.loadgen.bench.generative import (
    CONTINUOUS,
    PER_REQUEST,
    STATIC,
    InProcess,
    Job,
    closed_loop,
    evaluate_targets,
    figures,
    plot_generate,
    tables,
)

PNG = b"\x89PNG\r\n\x1a\n"


def test_the_closed_loop_keeps_each_stream_busy_and_traces_every_request():
    """A contender that makes 3 tokens 5 ms apart per request, serving up to ``streams`` requests at once."""
    running: list[Job] = []
    lock = threading.Lock()
    most = []

    def send(job: Job) -> None:
        with lock:
            running.append(job)
            most.append(len(running))

    def serve(stopping: threading.Event) -> None:
        while not stopping.is_set() or running:
            with lock:
                jobs = list(running)
            for _ in range(3):
                time.sleep(0.005)
                for _, trace, _ in jobs:
                    trace.tokens.append(time.perf_counter())
            for job in jobs:
                with lock:
                    running.remove(job)
                job[2].set()
            time.sleep(0.001)

    traces, wall = closed_loop(InProcess(send, serve), [f"p{i}" for i in range(12)], 4)
    assert len(traces) == 12 and all(len(trace.tokens) == 3 for trace in traces)
    assert max(most) <= 4 and wall > 0
    row = figures(4, [(traces, wall)])
    assert row["concurrency"] == 4 and row["sent"] == 12
    generation = row["generation"]
    assert generation["tokens"] == 36 and generation["tokens_per_s"] == round(36 / wall, 3)
    assert generation["ttfc_ms"]["p50"] >= 5 and generation["between_chunks_ms"]["p50"] >= 5
    assert (generation["finished"], generation["aborted"]) == (12, 0)


def run(contender: str, streams: int, tokens_s: float, ttfc: float, gap: float = 8.0) -> dict:
    percent = {"p50": ttfc, "p90": ttfc, "p99": ttfc * 2, "p999": ttfc * 2, "max": ttfc * 2, "mean": ttfc}
    gaps = {key: gap for key in percent}
    return {"contender": contender, "concurrency": streams, "sent": 8,
            "generation": {"tokens_per_s": tokens_s, "ttfc_ms": percent, "between_chunks_ms": gaps, "tokens": 256,
                           "finished": 8, "aborted": 0, "finish_reasons": {"length": 8}, "restarts": 0}}


RUNS = [run(CONTINUOUS, 32, 1800, 50), run(PER_REQUEST, 32, 120, 4000), run(STATIC, 32, 500, 700),
        run("kinference (Kafka)", 32, 600, 90), run(CONTINUOUS, 1, 120, 14), run(PER_REQUEST, 1, 125, 12),
        run(STATIC, 1, 90, 63), run("kinference (Kafka)", 1, 100, 20)]


def test_targets_are_the_issues_ratios_within_the_run():
    targets = {t["target"]: t for t in evaluate_targets(RUNS)}
    assert len(targets) == 3
    four, static, first = targets.values()
    assert (four["value"], four["limit"], four["met"]) == (15.0, 4.0, True)
    assert (static["value"], static["met"]) == (3.6, True)
    assert (first["value"], first["limit"], first["met"]) == (round(14 / 12, 3), 1.2, True)
    slow = evaluate_targets([run(CONTINUOUS, 1, 120, 20), run(PER_REQUEST, 1, 125, 12)])
    assert len(slow) == 1 and not slow[0]["met"]


def test_tables_list_each_contender_at_32_streams_then_1(tmp_path):
    report = {"runs": RUNS, "targets": evaluate_targets(RUNS)}
    (_, header, rows), (_, _, target_rows) = tables(report)
    assert header[:4] == ["contender", "streams", "tokens/s", "TTFC p50"]
    assert [(row[0], row[1]) for row in rows] == [(r["contender"], str(r["concurrency"])) for r in RUNS]
    assert rows[0][2:5] == ["1800", "50.0", "100"] and rows[0][-1] == "8 / 0"
    assert [row[3] for row in target_rows] == ["yes", "yes", "yes"]
    assert plot_generate(report, tmp_path / "generate.png").read_bytes().startswith(PNG)


def test_the_kafka_contenders_are_kinference_settings():
    from kinference.consumer.config import ServiceConfig

    for name, overrides in generative.KAFKA_SETTINGS:
        assert name.startswith("kinference")
        ServiceConfig(**overrides)  # a setting kinference does not accept fails here, not half-way through a run
