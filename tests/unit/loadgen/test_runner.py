"""The load loops on a fake client (no broker): warm-up, counts, concurrency, rate, outcomes."""

from __future__ import annotations

import asyncio
import io
import re
import time

import orjson
import pytest
from rich.console import Console

from kinference import protocol
from kinference.loadgen.errors import RequestTimeout
from kinference.loadgen.live import LINE_WIDTH, LiveStats, ProgressView
from kinference.loadgen.pending import ClientStats
from kinference.loadgen.reply import Reply
from kinference.loadgen.runner import LoadPlan, run_load, run_sweep
from kinference.loadgen.stream import Stream
from tests.fakes import FakeRecord


class FakeClient:
    """Answers after ``latency_s``; every ``lose_every``-th request times out, every
    ``error_every``-th gets an error reply."""

    def __init__(self, latency_s: float = 0.005, lose_every: int = 0, error_every: int = 0) -> None:
        self.latency_s, self.lose_every, self.error_every = latency_s, lose_every, error_every
        self.sent: list = []
        self.in_flight = self.max_in_flight = 0
        self.duplicates = 0

    async def request_async(self, value, *, timeout_s: float) -> Reply:
        self.sent.append(value)
        n = len(self.sent)
        sent_at = time.monotonic()
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.lose_every and n % self.lose_every == 0:
                await asyncio.sleep(timeout_s)
                raise RequestTimeout("no reply")
            await asyncio.sleep(self.latency_s)
        finally:
            self.in_flight -= 1
        error = self.error_every and n % self.error_every == 0
        headers = {protocol.STATUS: b"error" if error else b"ok", protocol.BATCH_SIZE: b"2"}
        if error:
            headers[protocol.ERROR_CODE] = b"handler_error"
        return Reply(str(n), None, orjson.dumps({"result": value}), headers, sent_at, time.monotonic())

    def stats(self) -> ClientStats:
        self.duplicates += 1  # the run reports the difference between its start and end
        return ClientStats(duplicates=self.duplicates)


def run(client: FakeClient, **plan) -> dict:
    result = asyncio.run(run_load(client, LoadPlan(**plan), [{"text": "a"}, {"text": "b"}]))
    return result.report()


def test_closed_loop_measures_exactly_n_requests_after_the_warm_up():
    client = FakeClient()
    report = run(client, concurrency=4, requests=100, warmup_s=0.1)
    assert report["sent"] == report["ok"] == 100
    assert len(client.sent) > 100, "warm-up requests were sent but not measured"
    assert client.max_in_flight == 4
    assert report["mode"] == "closed" and report["concurrency"] == 4
    assert report["duplicates"] == 1
    assert report["latency_ms"]["p50"] >= 5.0
    assert report["server"]["batch_size"]["mean"] == 2.0


def test_closed_loop_for_a_duration_counts_lost_and_error_replies():
    report = run(FakeClient(lose_every=10, error_every=7), concurrency=8, duration_s=0.5, warmup_s=0,
                 timeout_s=0.05)
    assert report["sent"] == report["ok"] + sum(report["errors"].values()) + report["lost"]
    assert report["lost"] > 0 and report["errors"]["handler_error"] > 0
    assert report["throughput_rps"] > 0


def test_open_loop_keeps_the_rate_whatever_the_latency():
    client = FakeClient(latency_s=0.2)
    report = run(client, rate=200, arrivals="constant", duration_s=0.5, warmup_s=0)
    assert report["sent"] == pytest.approx(100, abs=3)
    assert client.max_in_flight >= 30, "requests do not wait for earlier replies"
    assert report["mode"] == "open" and report["rate"] == 200


def test_open_loop_poisson_arrivals_average_the_rate():
    report = run(FakeClient(), rate=400, duration_s=0.5, warmup_s=0, seed=3)
    assert report["sent"] == pytest.approx(200, rel=0.25)


def test_sweep_gives_one_report_per_concurrency():
    results = asyncio.run(run_sweep(FakeClient(), LoadPlan(concurrency=1, requests=20, warmup_s=0), [1, 4],
                                    [{"text": "a"}]))
    assert [r.report()["concurrency"] for r in results] == [1, 4]
    assert all(r.report()["ok"] == 20 for r in results)


@pytest.mark.parametrize("plan", [
    {}, {"concurrency": 1, "rate": 5.0}, {"concurrency": 0}, {"rate": -1.0},
    {"concurrency": 1, "requests": 5, "duration_s": 1.0}, {"concurrency": 1, "timeout_s": 0},
])
def test_invalid_plans_fail_at_construction(plan):
    with pytest.raises(ValueError):
        LoadPlan(**plan)


def test_default_plan_runs_ten_seconds():
    assert LoadPlan(concurrency=1).duration_s == 10.0


def test_live_figures_cover_the_last_seconds_only():
    live = LiveStats(window_s=1.0)
    for i in range(100):
        live.on_sent()
        live.on_done(10.0 + i * 0.001, float(i))
    live.on_done(10.5, None)
    assert (live.sent, live.answered, live.lost) == (100, 100, 1)
    assert live.rolling(10.5) == (100.0, 98.0)
    assert live.rolling(12.0) == (0.0, None), "nothing answered in the last second"


def test_progress_view_renders_a_run():
    output = io.StringIO()
    with ProgressView(Console(file=output, width=120, force_terminal=True)) as view:
        asyncio.run(run_load(FakeClient(), LoadPlan(concurrency=2, requests=30, warmup_s=0.3), [1], view, "c=2"))
    text = output.getvalue()
    assert "c=2" in text and "sent" in text


def test_progress_line_fits_76_columns_with_its_elapsed_time():
    """The demo's line was cut at 76 columns (`0:00:…`): with five-digit counts it must fit, the time included."""
    output = io.StringIO()
    live = LiveStats()
    live.sent, live.answered, live.lost = 12345, 12300, 45
    live.on_done(10.0, 1234.5)
    with ProgressView(Console(file=output, width=76, force_terminal=True, color_system=None)) as view:
        view.begin("warm-up", total=100)
        view.update(live, now=10.0, completed=50)
    lines = [line.rstrip() for line in re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", output.getvalue()).splitlines()]
    line = [line for line in lines if "sent" in line][-1]  # the last refresh
    assert "…" not in line and re.search(r"\d:\d\d:\d\d$", line), line
    assert len(line) <= LINE_WIDTH and "12345" in line and "1234.5ms" in line, line


class FakeGenerator(FakeClient):
    """Streams each generation as two chunks 10 ms apart and then its final (``usage`` of 4 tokens); every
    ``restart_every``-th starts over under a new attempt after its first chunk, every ``abort_every``-th ends with
    ``finish_reason`` ``deadline``, every ``error_every``-th is an error reply."""

    def __init__(self, restart_every: int = 0, abort_every: int = 0, **options) -> None:
        super().__init__(**options)
        self.restart_every, self.abort_every = restart_every, abort_every
        self.tasks: set[asyncio.Task] = set()

    async def stream_async(self, value, *, timeout_s: float) -> Stream:
        self.sent.append(value)
        n = len(self.sent)
        records: asyncio.Queue = asyncio.Queue()
        task = asyncio.create_task(self._generate(n, records))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return Stream(records, time.monotonic() + timeout_s, str(n), time.monotonic(), lambda: None)

    async def _generate(self, n: int, records: asyncio.Queue) -> None:
        steps = [("a", 0, "delta"), ("a", 1, "delta"), ("a", 2, "final")]
        if self.restart_every and n % self.restart_every == 0:
            steps = [("a", 0, "delta"), *(("b", *step[1:]) for step in steps)]
        if self.error_every and n % self.error_every == 0:
            steps = [("a", 0, "error")]
        reason = "deadline" if self.abort_every and n % self.abort_every == 0 else "length"
        for attempt, sequence, event in steps:
            await asyncio.sleep(0.01)
            records.put_nowait((_generation_record(attempt, sequence, event, reason), time.monotonic()))


def _generation_record(attempt: str, sequence: int, event: str, reason: str) -> FakeRecord:
    headers = [(protocol.CORRELATION_ID, b"c"), (protocol.SEQUENCE, str(sequence).encode()),
               (protocol.ATTEMPT, attempt.encode())]
    if event == "error":
        return FakeRecord(protocol.encode_error(protocol.ErrorCode.HANDLER_ERROR, "engine failed"),
                          [*headers, (protocol.STATUS, b"error"), (protocol.ERROR_CODE, b"handler_error")])
    if event == "delta":
        value = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "ab"}}]}
    else:
        value = {"object": "chat.completion", "usage": {"completion_tokens": 4},
                 "choices": [{"index": 0, "message": {"content": "abab"}, "finish_reason": reason}]}
    return FakeRecord(orjson.dumps(value), [*headers, (protocol.EVENT, event.encode())])


def test_a_generative_run_measures_chunks_tokens_and_how_each_generation_ended():
    client = FakeGenerator(restart_every=3, abort_every=4, error_every=5)
    result = asyncio.run(run_load(client, LoadPlan(concurrency=2, requests=20, warmup_s=0, generative=True),
                                  [{"prompt": "a"}]))
    report = result.report()
    generation = report["generation"]
    assert (report["sent"], report["ok"], report["errors"]) == (20, 16, {"handler_error": 4})
    assert (generation["finished"], generation["aborted"]) == (12, 4)
    assert generation["finish_reasons"] == {"deadline": 4, "length": 12}
    assert generation["restarts"] == 5 and generation["tokens"] == 16 * 4 and generation["tokens_per_s"] > 0
    # The first chunk 10 ms after sending (20 ms when it restarted: the new attempt's), the next 10 ms later, the
    # final 10 ms after that: the latency is the whole generation's. (The slowest first chunk is not compared with
    # the latency's median: on a loaded machine one late first chunk passed it, 49 ms against 37.)
    assert 10 <= generation["ttfc_ms"]["p50"] <= generation["ttfc_ms"]["max"]
    assert generation["ttfc_ms"]["p50"] < report["latency_ms"]["p50"]
    assert generation["between_chunks_ms"]["p50"] >= 10
    restarted = [s for s in result.samples if s.restarts]
    assert restarted and all(len(s.chunk_gaps_ms) == 1 for s in restarted), "only the answering attempt's chunks"
    assert client.sent == [{"prompt": "a"}] * 20
