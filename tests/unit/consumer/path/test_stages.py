import math
import queue
import sys
import threading
import time

import numpy as np
import pytest

from kinference.consumer.config import Batching, Parallelism
from kinference.consumer.ops.metrics import Metrics
from kinference.consumer.path import results
from kinference.consumer.path.batcher import Batcher
from kinference.consumer.path.results import MAX_RESULT_DEPTH, finite, reply_value
from kinference.consumer.path.stages import InProcessInference, ModelRun, Pipeline
from kinference.errors import InvalidInput, RequestError
from kinference.handlers.base import Handler
from kinference.handlers.echo import EchoHandler
from tests.fakes import FakeBatches, admit, make_request, wait_for


def run(handler: Handler, **batching) -> ModelRun:
    """The handler as model ``m``, with these batching settings."""
    return ModelRun("m", handler, Batching(**batching), InProcessInference(handler))


class SquareHandler(Handler):
    """Squares numbers. Payload {"x": n}; magic values trigger the failure modes under test."""

    def __init__(self, infer_delay=None):
        self.infer_delay = infer_delay or (lambda inputs: 0.0)
        self.concurrent = 0
        self.max_concurrent = 0
        self._lock = threading.Lock()

    def validate(self, payload):
        if not isinstance(payload, dict) or not isinstance(payload.get("x"), int):
            raise InvalidInput("x must be an integer")
        return payload["x"]

    def preprocess(self, items):
        return list(items)

    def inference(self, inputs):
        with self._lock:
            self.concurrent += 1
            self.max_concurrent = max(self.max_concurrent, self.concurrent)
        try:
            time.sleep(self.infer_delay(inputs))
            if -1 in inputs:
                raise RuntimeError("model exploded")
            return [x * x for x in inputs]
        finally:
            with self._lock:
                self.concurrent -= 1

    def postprocess(self, outputs, items):
        if -2 in items:
            return outputs[:-1]  # one output short
        results = []
        for item, out in zip(items, outputs, strict=True):
            if item == -3:
                results.append(InvalidInput("negative three is not allowed"))
            elif item == -4:
                results.append({"y": object()})  # not JSON-serialisable
            elif item == -5:
                results.append({"y": math.nan})
            elif item == -6:
                results.append(deeply_nested(400))
            else:
                results.append({"y": out})
        return results


def deeply_nested(depth):
    value = [1.0]
    for _ in range(depth - 1):
        value = [value]
    return value


def run_pipeline(handler, batches, *, micro=None, threads=(1, 1, 1), max_batch_size=64):
    """Admit every request as the service does (a bad one fails there), then run the batches."""
    pending = queue.Queue()
    for batch in batches:
        for request in batch:
            if request.ok:
                admit(handler, [request])
        pending.put(batch)
    emitted, done = [], threading.Event()
    total = sum(len(b) for b in batches)

    def next_batch(timeout_s, only_full):
        try:
            return pending.get(timeout=timeout_s)
        except queue.Empty:
            return []

    def emit(requests):
        emitted.extend(requests)
        if len(emitted) >= total:
            done.set()

    parallelism = Parallelism(preprocess=threads[0], inference=threads[1], postprocess=threads[2])
    pipeline = Pipeline(run(handler, parallelism=parallelism, max_batch_size=max_batch_size, micro_batch_size=micro),
                        FakeBatches(next_batch), emit, Metrics())
    pipeline.start()
    try:
        assert done.wait(10), f"only {len(emitted)} of {total} requests came out"
        assert pipeline.healthy
    finally:
        pipeline.stop(5)
    return emitted


def reply(request):
    import orjson

    return orjson.loads(request.reply_value)["result"] if request.ok else request.error.code


def test_results_match_requests_when_micro_batches_finish_out_of_order():
    # The first micro-batch is the slowest, so later ones overtake it in the inference pool.
    handler = SquareHandler(infer_delay=lambda inputs: 0.2 if inputs[0] == 0 else 0.0)
    batch = [make_request({"x": i}) for i in range(16)]
    sent = {id(r): r.payload["x"] for r in batch}  # the stages let the payloads go once done with them
    emitted = run_pipeline(handler, [batch], micro=4, threads=(2, 3, 2))
    assert len(emitted) == 16 and {id(r) for r in emitted} == {id(r) for r in batch}
    assert [sent[id(r)] for r in emitted[:4]] != [0, 1, 2, 3]  # really out of order
    for request in batch:
        assert reply(request) == {"y": sent[id(request)] ** 2}


def test_torchserve_micro_batching_config_shares_one_handler():
    handler = SquareHandler(infer_delay=lambda inputs: 0.01)
    batches = [[make_request({"x": i + 10 * b}) for i in range(8)] for b in range(5)]
    sent = {id(r): r.payload["x"] for batch in batches for r in batch}
    emitted = run_pipeline(handler, batches, micro=4, threads=(2, 1, 2))
    assert len(emitted) == 40 and all(reply(r) == {"y": sent[id(r)] ** 2} for r in emitted)
    assert handler.max_concurrent == 1  # one inference thread


def test_the_stages_let_each_request_s_decoded_value_go_when_they_hand_it_on():
    """Issue 37: the runner, not the byte budget, drops what a finished request holds decoded: the publisher keeps
    it until its answer is delivered, and must not keep its payload alive meanwhile."""
    batch = [make_request({"x": i}) for i in range(6)] + [make_request({"x": "one"})]
    emitted = run_pipeline(SquareHandler(infer_delay=lambda inputs: 0.0), [batch], micro=4, threads=(1, 1, 1))
    assert len(emitted) == 7 and batch[0].item is None
    assert all(request.payload is None and request.item is None for request in emitted)
    assert [reply(request) for request in batch[:6]] == [{"y": i * i} for i in range(6)]
    assert not batch[6].ok  # failed at admission, its payload let go with its micro-batch's


def test_one_inference_slot_per_thread():
    handler = SquareHandler(infer_delay=lambda inputs: 0.02)
    batches = [[make_request({"x": i})] for i in range(12)]
    run_pipeline(handler, batches, threads=(1, 2, 1))
    assert handler.max_concurrent == 2


def test_bad_items_fail_alone_and_neighbours_succeed():
    payloads = [{"x": 1}, {"x": "one"}, "garbage", {"x": 3}, {"x": -3}, {"x": -4}, {"x": 4}]
    batch = [make_request(p) for p in payloads]
    run_pipeline(SquareHandler(), [batch])
    assert [reply(r) for r in batch] == [
        {"y": 1}, "bad_request", "bad_request", {"y": 9}, "bad_request", "handler_error", {"y": 16},
    ]


def test_nan_in_output_fails_that_request_only():
    batch = [make_request({"x": -5})]
    run_pipeline(SquareHandler(), [batch])
    assert batch[0].error.code == "handler_error" and "NaN or infinity" in batch[0].error.message


def test_exception_fails_only_its_micro_batch_and_pipeline_keeps_running():
    poisoned = [make_request({"x": v}) for v in (1, -1, 2, 3)]
    healthy = [make_request({"x": v}) for v in (5, 6, 7, 8)]
    later = [make_request({"x": 9})]
    run_pipeline(SquareHandler(), [poisoned + healthy, later], micro=4)
    assert {r.error.code for r in poisoned} == {"handler_error"}
    assert "model exploded" in poisoned[0].error.message
    assert [reply(r) for r in healthy] == [{"y": 25}, {"y": 36}, {"y": 49}, {"y": 64}]
    assert reply(later[0]) == {"y": 81}


def test_a_deeply_nested_result_fails_only_its_own_request():
    """Issue 20, defect 1: the finiteness check recursed, and a 400-deep result failed its whole micro-batch."""
    batch = [make_request({"x": v}) for v in (1, -6, 2)]
    run_pipeline(SquareHandler(), [batch])
    assert reply(batch[0]) == {"y": 1} and reply(batch[2]) == {"y": 4}
    assert batch[1].error.code == "handler_error" and "nested deeper than" in batch[1].error.message


def test_finite_is_iterative_and_bounded_in_depth():
    assert finite(deeply_nested(MAX_RESULT_DEPTH))
    with pytest.raises(RequestError, match="nested deeper than"):
        finite(deeply_nested(100_000))
    cycle = [1.0]
    cycle.append(cycle)
    cycle.append(cycle)
    assert finite(cycle)


@pytest.mark.parametrize("result", [
    {"embedding": np.array([0.5, np.nan], dtype=np.float32)},
    {"embedding": np.array([np.inf], dtype=np.float16)},
    [1.0, -math.inf],
    {"score": np.float64("nan")},
    ({"a": [1.0, math.nan]}, "tuple"),
    {"nan": float("nan"), "also": object()},  # not serialisable either: the NaN is what the error says, as before
])
def test_a_result_with_nan_or_infinity_anywhere_is_refused(result):
    with pytest.raises(RequestError, match="NaN or infinity"):
        reply_value(make_request({}), result)


def test_a_finite_result_is_encoded_once_and_walked_only_when_its_json_holds_a_null(monkeypatch):
    """Issue 27: the walk for NaN (``finite``) cost a few microseconds per embedding; orjson writes NaN and infinity
    as null, so JSON without a null needs no walk."""
    walked = []
    monkeypatch.setattr(results, "finite", lambda result: walked.append(result) or finite(result))
    embedding = {"embedding": np.array([0.25, -1.5], dtype=np.float32)}
    assert reply_value(make_request({}), embedding) == b'{"result":{"embedding":[0.25,-1.5]}}'
    assert walked == []
    with_null = {"label": None, "text": "null"}
    assert reply_value(make_request({}), with_null) == b'{"result":{"label":null,"text":"null"}}'
    assert walked == [with_null]
    assert reply_value(make_request({}), deeply_nested(MAX_RESULT_DEPTH - 1)).startswith(b'{"result":[[')
    with pytest.raises(RequestError, match="nested deeper than"):
        reply_value(make_request({}), deeply_nested(MAX_RESULT_DEPTH + 1))
    with pytest.raises(RequestError, match="not JSON-serialisable"):
        reply_value(make_request({}), {"y": object()})


@pytest.mark.parametrize("raised", [SystemExit, GeneratorExit, BaseExceptionGroup])
def test_a_handler_raising_a_base_exception_fails_its_micro_batch_and_the_pipeline_keeps_serving(raised):
    """Issue 20, defect 8: a ``SystemExit`` from a handler killed the inference thread, and the micro-batch was
    never answered."""

    class Raising(SquareHandler):
        def inference(self, inputs):
            if -7 in inputs:
                raise raised("boom") if raised is not BaseExceptionGroup else raised("boom", [SystemExit(1)])
            return super().inference(inputs)

    poisoned = [make_request({"x": v}) for v in (1, -7)]
    later = [make_request({"x": 3})]
    run_pipeline(Raising(), [poisoned, later])
    assert {r.error.code for r in poisoned} == {"handler_error"}
    assert raised.__name__ in poisoned[0].error.message
    assert reply(later[0]) == {"y": 9}


def test_a_validate_calling_sys_exit_fails_its_own_request_in_admission():
    class ExitingValidate(SquareHandler):
        def validate(self, payload):
            if payload == {"x": -7}:
                sys.exit(3)
            return super().validate(payload)

    requests = [make_request({"x": v}) for v in (1, -7, 2)]
    admit(ExitingValidate(), requests)
    assert [r.item for r in requests] == [1, None, 2]
    assert requests[1].error.code == "handler_error" and "SystemExit" in requests[1].error.message


def test_wrong_number_of_outputs_fails_every_request_of_the_micro_batch():
    batch = [make_request({"x": v}) for v in (1, 2, -2)]
    run_pipeline(SquareHandler(), [batch])
    assert all(r.error.code == "handler_error" for r in batch)
    assert "2 results for 3 requests" in batch[0].error.message


def test_already_failed_requests_pass_through_untouched():
    failed = make_request({"x": 1})
    failed.fail(RequestError("expired", "deadline_exceeded"))
    ok = make_request({"x": 2})
    run_pipeline(SquareHandler(), [[failed, ok]])
    assert failed.error.code == "deadline_exceeded" and reply(ok) == {"y": 4}


@pytest.mark.parametrize("micro", [None, 1, 3])
def test_every_request_comes_out_exactly_once(micro):
    batches = [[make_request({"x": i}) for i in range(n)] for n in (1, 7, 16, 5)]
    emitted = run_pipeline(SquareHandler(), batches, micro=micro, threads=(2, 2, 2), max_batch_size=16)
    assert sorted(id(r) for r in emitted) == sorted(id(r) for b in batches for r in b)


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ({"embedding": [0.1, 0.2]}, True),
        ({"embedding": [0.1, math.nan]}, False),
        ([1, 2.5, "x", None, {"a": [math.inf]}], False),
        ({"labels": [{"label": "pos", "score": 0.9}]}, True),
        (np.array([1.0, np.nan]), False),
        (np.array([1, 2]), True),
        (np.float32("inf"), False),
        ([], True),
    ],
)
def test_finite_finds_nan_and_infinity_anywhere(value, ok):
    assert finite(value) is ok


def test_each_inference_thread_warms_the_model_up_before_serving():
    class WarmedPerThread(SquareHandler):
        def __init__(self):
            super().__init__()
            self.warmed_in = []

        def warm_up(self):
            self.warmed_in.append(threading.current_thread().name)

    handler = WarmedPerThread()
    run_pipeline(handler, [[make_request({"x": 3})]], threads=(1, 2, 1))
    assert sorted(handler.warmed_in) == ["kinference-inference-0", "kinference-inference-1"]


def test_a_failing_warm_up_fails_start_and_stops_the_threads():
    class ColdModel(SquareHandler):
        def warm_up(self):
            raise RuntimeError("CUDA out of memory")

    pipeline = Pipeline(run(ColdModel(), max_batch_size=4), FakeBatches(lambda timeout_s, only_full: []),
                        lambda requests: None, Metrics())
    with pytest.raises(RuntimeError, match="out of memory"):
        pipeline.start()
    time.sleep(0.2)
    stages = ("kinference-preprocess", "kinference-inference", "kinference-postprocess", "kinference-dispatch")
    assert not any(t.name.startswith(stages) and t.is_alive() for t in threading.enumerate())


class CostHandler(SquareHandler):
    def __init__(self, cost):
        super().__init__()
        self._cost = cost

    def cost(self, item):
        return self._cost(item)


@pytest.mark.parametrize("cost", [lambda item: "12", lambda item: True, lambda item: -1, lambda item: 1.5,
                                  lambda item: 1 / 0])
def test_a_cost_hook_that_raises_or_returns_no_token_count_fails_its_request_only(cost):
    request = make_request({"x": 3})
    admit(CostHandler(cost), [request])
    assert request.error.code == "handler_error" and request.tokens is None
    good = make_request({"x": 3})
    admit(CostHandler(lambda item: 7), [good])
    assert good.ok and good.tokens == 7


class StuckHandler(SquareHandler):
    def __init__(self):
        super().__init__()
        self.release = threading.Event()
        self.entered = threading.Event()

    def inference(self, inputs):
        self.entered.set()
        self.release.wait(30)
        return super().inference(inputs)


def test_stop_returns_by_its_deadline_when_a_handler_call_never_returns():
    handler = StuckHandler()
    batches: queue.Queue = queue.Queue()
    for i in range(6):
        batches.put([make_request({"x": i})])
    pipeline = Pipeline(run(handler, max_batch_size=1),
                        FakeBatches(lambda timeout, only_full: [] if batches.empty() else batches.get()),
                        lambda requests: None, Metrics())
    pipeline.start()
    assert handler.entered.wait(5)
    started = time.monotonic()
    assert pipeline.stop(0.5) is False  # the inference thread is still inside the handler
    assert time.monotonic() - started < 2.0
    handler.release.set()


def test_inference_threads_warm_up_one_at_a_time():
    class Warm(SquareHandler):
        def __init__(self):
            super().__init__()
            self.warming, self.overlap = 0, False

        def warm_up(self):
            with self._lock:
                self.warming += 1
                self.overlap |= self.warming > 1
            time.sleep(0.05)
            with self._lock:
                self.warming -= 1

    handler = Warm()
    pipeline = Pipeline(run(handler, max_batch_size=4, parallelism=Parallelism(inference=4)),
                        FakeBatches(lambda timeout, only_full: []), lambda requests: None, Metrics())
    pipeline.start()
    assert pipeline.stop(5)
    assert not handler.overlap


def test_a_busy_inference_thread_gets_a_full_batch_queued_behind_it_but_never_a_partial_one():
    """Prefetch with one inference thread and a real batcher: while a batch runs, a partial batch keeps waiting
    in the batcher (where the policy and the deadlines still apply), a full one is taken and preprocessed."""
    handler = StuckHandler()
    emitted: list = []
    batcher = Batcher(Batching(batch_policy="greedy", max_batch_size=4, max_batch_delay_ms=0.0, max_batch_tokens=None,
                               max_batch_bytes=None), lambda requests: None)
    pipeline = Pipeline(run(handler, max_batch_size=4), batcher, emitted.extend, Metrics())

    def put(*values):
        for value in values:
            request = make_request({"x": value})
            admit(handler, [request])
            batcher.put([request])

    pipeline.start()
    try:
        put(1)
        assert handler.entered.wait(5)  # that batch holds the only inference thread
        put(2, 3)
        time.sleep(0.3)
        assert batcher.waiting == 2  # partial: not taken
        put(4, 5)
        assert wait_for(lambda: batcher.waiting == 0, 2)  # full: taken, waits in the inference queue
        handler.release.set()
        assert wait_for(lambda: len(emitted) == 5, 5)
    finally:
        handler.release.set()
        pipeline.stop(5)
    assert [request.batch_size for request in emitted] == [1, 4, 4, 4, 4]


@pytest.mark.parametrize("stage", ["preprocess", "inference", "postprocess"])
def test_a_handler_call_over_the_timeout_is_answered_with_handler_timeout_once_and_the_model_is_unhealthy(stage):
    """Issue 20, defect 7: a hung handler call held its requests (and, through max_in_flight, every partition)
    forever, and health stayed good. Its requests are answered at the timeout now, as dead letters too; the
    model turns unhealthy; and when the call returns at last, nothing is answered twice."""
    release = threading.Event()

    class Hanging(SquareHandler):
        def preprocess(self, items):
            if stage == "preprocess" and 13 in items:
                release.wait(10)
            return super().preprocess(items)

        def inference(self, inputs):
            if stage == "inference" and 13 in inputs:
                release.wait(10)
            return super().inference(inputs)

        def postprocess(self, outputs, items):
            if stage == "postprocess" and 13 in items:
                release.wait(10)
            return super().postprocess(outputs, items)

    pending = queue.Queue()
    stuck, later = [make_request({"x": v}) for v in (13, 2)], [make_request({"x": 3})]
    for batch in (stuck, later):
        admit(Hanging(), batch)
        pending.put(batch)
    emitted = []

    def next_batch(timeout_s, only_full):
        try:
            return pending.get(timeout=timeout_s)
        except queue.Empty:
            return []

    pipeline = Pipeline(run(Hanging(), parallelism=Parallelism(inference=2), max_batch_size=8, handler_timeout_s=0.3),
                        FakeBatches(next_batch), emitted.extend, Metrics())
    pipeline.start()
    try:
        assert wait_for(lambda: all(any(r is e for e in emitted) for r in stuck), 5), len(emitted)
        assert {r.error.code for r in stuck} == {"handler_timeout"} and all(r.dead_letter for r in stuck)
        assert f"{stage} of model 'm'" in stuck[0].error.message
        assert "handler_timeout_s (0.3 s)" in stuck[0].error.message
        assert not pipeline.healthy and "model 'm'" in pipeline.stuck
        release.set()
        assert wait_for(lambda: len(emitted) == 3 and pipeline.in_progress == 0, 5)
        time.sleep(0.2)
        assert len(emitted) == 3 and reply(later[0]) == {"y": 9}
        assert {r.error.code for r in stuck} == {"handler_timeout"}
    finally:
        release.set()
        pipeline.stop(5)


class Doubler(Handler):
    """The smallest handler: ``inference`` alone; preprocess and postprocess are the contract's defaults."""

    def inference(self, inputs):
        return (2 * item["x"] for item in inputs)  # any iterable: the default postprocess makes it a list


@pytest.mark.parametrize("handler", [Doubler(), EchoHandler()], ids=["inference-only", "echo"])
def test_a_handler_that_defines_only_inference_serves_one_result_per_request(handler):
    batch = [make_request({"x": i}) for i in range(10)]
    emitted = run_pipeline(handler, [batch], micro=4, threads=(2, 2, 2))
    assert {id(r) for r in emitted} == {id(r) for r in batch}
    expected = [2 * i for i in range(10)] if isinstance(handler, Doubler) else [{"x": i} for i in range(10)]
    assert [reply(request) for request in batch] == expected
