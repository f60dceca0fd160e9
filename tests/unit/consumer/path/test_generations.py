"""The generative runner (consumer/path/generations.py) against a scripted engine: admission caps per model and per
partition, chunk coalescing, the final's chat.completion, a keyless stream on one partition, deadlines, revokes, no
chunks where the delivery mode produces none."""

from __future__ import annotations

import queue
import threading
import time
import zlib
from typing import Any

import orjson
import pytest

from kinference.consumer.delivery.answers import StreamChunk, answer
from kinference.consumer.ledger.request import Request
from kinference.consumer.ops.metrics import Metrics
from kinference.consumer.path.admission import Admission
from kinference.consumer.path.generations import GenerationSettings, GenerativeRunner
from kinference.handlers.generative import SERVING, EngineHealth, Event, GenerativeHandler, Prompt, Sampling
from kinference.protocol import ATTEMPT, EVENT, SEQUENCE, ErrorCode
from tests.fakes import make_request, wait_for


class ScriptedEngine(GenerativeHandler):
    """Generates nothing by itself: the test pushes each token (``step``); ``cancel`` ends a request as the port
    says, with one ``cancelled`` event."""

    def __init__(self) -> None:
        self.submitted: list[str] = []
        self.cancelled: list[str] = []
        self._events: queue.Queue[Event] = queue.Queue()
        self._text: dict[str, str] = {}

    def validate(self, payload: Any) -> Prompt:
        return Prompt((1, 2, 3), Sampling(16), stream=payload["stream"])

    def submit(self, request_id: str, prompt: Prompt) -> None:
        self.submitted.append(request_id)
        self._text[request_id] = ""

    def cancel(self, request_id: str) -> None:
        if self._text.pop(request_id, None) is not None:
            self.cancelled.append(request_id)
            self._events.put(Event(request_id, "cancelled"))

    def step(self, request_id: str, text: str, final: bool = False) -> None:
        self._text[request_id] += text
        tokens = len(self._text[request_id].split())
        self._events.put(Event(request_id, "delta", text, tokens, 3))
        if final:
            self._events.put(Event(request_id, "final", self._text.pop(request_id), tokens, 3, "stop"))

    def lose(self, request_id: str) -> None:
        """What the device process's link says of a request when its device process died: ``lost``."""
        self._text.pop(request_id)
        self._events.put(Event(request_id, "lost"))

    def events(self, timeout_s: float) -> list[Event]:
        try:
            events = [self._events.get(timeout=timeout_s)]
        except queue.Empty:
            return []
        while not self._events.empty():
            events.append(self._events.get())
        return events


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine()


class Outbox:
    """The publisher, as a generative runner hands its records on (``generations.Outlet``)."""

    def __init__(self, reply_partitions: int | None = 6) -> None:
        self.chunks: list[StreamChunk] = []
        self.answered: list[Request] = []
        self.lock = threading.Lock()
        self._reply_partitions = reply_partitions

    def stream(self, chunks: list[StreamChunk]) -> None:
        with self.lock:
            self.chunks += chunks

    def submit(self, requests: list[Request]) -> None:
        with self.lock:
            self.answered += requests

    def reply_partitions(self, _topic: str) -> int | None:
        return self._reply_partitions


def generations(engine: ScriptedEngine, outbox: Outbox, **overrides: Any) -> GenerativeRunner:
    settings = {"max_sequences": 4, "max_sequences_per_partition": 2, "stream_every_tokens": 3,
                "stream_every_s": 60.0, "chunks": True, **overrides}
    return GenerativeRunner(Admission("lm", engine, outbox.submit), engine, outbox, GenerationSettings(**settings),
                            Metrics())


def request(partition: int = 0, stream: bool = True, deadline_ms: int | None = None) -> Request:
    return make_request({"prompt": "x", "stream": stream}, partition=partition, deadline_ms=deadline_ms)


def test_admission_caps_sequences_per_model_and_per_partition(engine: ScriptedEngine) -> None:
    outbox = Outbox()
    gens = generations(engine, outbox)
    for partition in (0, 0, 0, 1, 1, 1):
        gens.put([request(partition)])
    # Two of partition 0, two of partition 1: the model's four places, each partition within its two.
    assert (gens.in_progress, gens.waiting) == (4, 2)
    gens.start()
    try:
        first = engine.submitted[0]
        engine.step(first, "done", final=True)
        assert wait_for(lambda: len(engine.submitted) == 5)  # a place freed: the oldest waiting of its partition
        assert engine.submitted[4].startswith("c")
    finally:
        gens.stop(2.0)


def test_chunks_coalesce_and_the_final_carries_the_whole_text(engine: ScriptedEngine) -> None:
    outbox = Outbox()
    gens = generations(engine, outbox)
    req = request()
    gens.put([req])
    gens.start()
    try:
        request_id = engine.submitted[0]
        for word in ["a", " b", " c", " d", " e", " f", " g"]:
            engine.step(request_id, word)
        engine.step(request_id, " h", final=True)
        assert wait_for(lambda: outbox.answered)
    finally:
        gens.stop(2.0)
    texts = [orjson.loads(c.value)["choices"][0]["delta"]["content"] for c in outbox.chunks]
    # The first at once, then every 3 tokens; what is left goes out before the final.
    assert texts[0] == "a" and "".join(texts) == "a b c d e f g h" and len(texts) >= 3
    headers = [dict(c.headers) for c in outbox.chunks]
    assert [h[SEQUENCE] for h in headers] == [str(i).encode() for i in range(len(texts))]
    assert {h[EVENT] for h in headers} == {b"delta"} and len({h[ATTEMPT] for h in headers}) == 1
    final = orjson.loads(req.reply_value)
    assert final["object"] == "chat.completion"
    assert final["choices"][0]["message"]["content"] == "a b c d e f g h"
    assert final["usage"] == {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11}
    final_headers = dict(req.reply_format.value_headers)
    assert final_headers[EVENT] == b"final" and final_headers[SEQUENCE] == str(len(texts)).encode()
    assert final_headers[ATTEMPT] == headers[0][ATTEMPT]


def test_a_passed_deadline_cancels_and_ends_with_finish_reason_deadline(engine: ScriptedEngine) -> None:
    outbox = Outbox()
    gens = generations(engine, outbox)
    req = request(deadline_ms=int(time.time() * 1000) + 300)
    gens.put([req])
    gens.start()
    try:
        engine.step(engine.submitted[0], "partial")
        assert wait_for(lambda: outbox.answered, timeout_s=10)
    finally:
        gens.stop(2.0)
    assert engine.cancelled == engine.submitted
    assert orjson.loads(req.reply_value)["choices"][0]["finish_reason"] == "deadline"


def test_a_revoke_cancels_its_generations_and_answers_none(engine: ScriptedEngine) -> None:
    outbox = Outbox()
    gens = generations(engine, outbox)
    kept, moved, queued = request(partition=0), request(partition=1), request(partition=1)
    for req in (kept, moved, request(partition=1), queued):
        gens.put([req])
    gens.start()
    try:
        dropped = gens.discard([("requests", 1)])
        assert set(map(id, dropped)) >= {id(moved), id(queued)} and kept not in dropped
        assert len(engine.cancelled) == 2 and (gens.in_progress, gens.waiting) == (1, 0)
        time.sleep(0.3)  # the engine's cancelled events arrive: nothing answers the dropped requests
        assert outbox.answered == []
    finally:
        gens.stop(2.0)


def test_no_chunks_without_stream_or_where_the_delivery_mode_produces_none(engine: ScriptedEngine) -> None:
    for stream, chunks in ((False, True), (True, False)):
        outbox = Outbox()
        gens = generations(engine, outbox, chunks=chunks)
        req = request(stream=stream)
        gens.put([req])
        gens.start()
        try:
            engine.step(engine.submitted[-1], "one two", final=True)
            assert wait_for(lambda: outbox.answered)  # noqa: B023 - waited for here, in this iteration
        finally:
            gens.stop(2.0)
        assert outbox.chunks == [] and orjson.loads(req.reply_value)["choices"][0]["message"]["content"] == "one two"


def test_a_keyless_stream_goes_to_one_partition_the_runner_pins_at_its_first_chunk(engine: ScriptedEngine) -> None:
    """The producer spreads keyless records over the partitions: the runner picks one for all of the request's."""
    outbox = Outbox(reply_partitions=6)
    gens = generations(engine, outbox)
    keyless, keyed, asked = request(partition=0), request(partition=1), request(partition=2)
    keyed.key, asked.reply_partition = b"k", 2
    for req in (keyless, keyed, asked):
        gens.put([req])
    gens.start()
    try:
        for request_id in engine.submitted:
            engine.step(request_id, "one two three four", final=True)
        assert wait_for(lambda: len(outbox.answered) == 3)
    finally:
        gens.stop(2.0)
    assert keyless.reply_partition == zlib.crc32(keyless.correlation_id.encode()) % 6
    assert (keyed.reply_partition, asked.reply_partition) == (None, 2)  # a key, or the client's own choice
    for req in (keyless, keyed, asked):
        (final,) = answer(req, "dead-letters", 0.0)
        assert {piece.record[4] for piece in outbox.chunks if piece.request is req} == {final.record[4]}


def test_an_engine_error_fails_that_request_alone_with_a_dead_letter(engine: ScriptedEngine) -> None:
    outbox = Outbox()
    gens = generations(engine, outbox)
    bad, good = request(), request()
    gens.put([bad])
    gens.put([good])
    gens.start()
    try:
        engine._events.put(Event(engine.submitted[0], "error", "the engine failed: boom"))
        engine.step(engine.submitted[1], "fine", final=True)
        assert wait_for(lambda: len(outbox.answered) == 2)
    finally:
        gens.stop(2.0)
    assert bad.error is not None and bad.dead_letter and "boom" in bad.error.message
    assert good.ok and orjson.loads(good.reply_value)["choices"][0]["message"]["content"] == "fine"


def test_a_cancel_stops_a_running_generation_and_ends_a_waiting_one(engine: ScriptedEngine) -> None:
    outbox = Outbox()
    gens = generations(engine, outbox, max_sequences=1)
    running, waiting, other = request(), request(), request()
    for req in (running, waiting, other):
        gens.put([req])
    gens.start()
    try:
        engine.step(engine.submitted[0], "so far")
        gens.cancel(running.correlation_id)
        gens.cancel(waiting.correlation_id)
        gens.cancel("nobody")
        assert wait_for(lambda: len(outbox.answered) == 2)
    finally:
        gens.stop(2.0)
    for req, text in ((running, "so far"), (waiting, "")):
        choice = orjson.loads(req.reply_value)["choices"][0]
        assert (choice["finish_reason"], choice["message"]["content"]) == ("cancelled", text)
    assert other not in outbox.answered and len(engine.submitted) == 2  # the other took the freed place


def test_a_lost_generation_is_generated_again_under_a_new_attempt_first_in_line(engine: ScriptedEngine) -> None:
    outbox = Outbox()
    gens = generations(engine, outbox, max_sequences=1)
    lost, waiting = request(), request()
    gens.put([lost])
    gens.put([waiting])
    gens.start()
    try:
        engine.step(engine.submitted[0], "old")
        assert wait_for(lambda: len(outbox.chunks) == 1)
        engine.lose(engine.submitted[0])
        # Its place is its own again, before the request that waited: the same request, a new attempt.
        assert wait_for(lambda: len(engine.submitted) == 2)
        assert engine.submitted[1].startswith(f"{lost.correlation_id}#") and engine.submitted[1] != engine.submitted[0]
        engine.step(engine.submitted[1], "new", final=True)
        assert wait_for(lambda: len(outbox.answered) == 1)
    finally:
        gens.stop(2.0)
    first, second = (dict(chunk.headers) for chunk in outbox.chunks)
    assert first[ATTEMPT] != second[ATTEMPT] and first[SEQUENCE] == second[SEQUENCE] == b"0"
    assert outbox.answered == [lost] and orjson.loads(lost.reply_value)["choices"][0]["message"]["content"] == "new"
    assert dict(lost.reply_format.value_headers)[ATTEMPT] == second[ATTEMPT]


def test_a_lost_generation_that_was_cancelled_ends_cancelled_and_one_lost_too_often_fails(
        engine: ScriptedEngine) -> None:
    from kinference.consumer.path.generations import MAX_ATTEMPTS

    outbox = Outbox()
    gens = generations(engine, outbox)
    cancelled, doomed = request(), request()
    gens.put([cancelled])
    gens.put([doomed])
    gens.start()
    try:
        engine.step(engine.submitted[0], "so far")
        gens.cancel(cancelled.correlation_id)  # the device process dies before its engine says it stopped
        engine._events.put(Event(engine.submitted[0], "lost"))
        for attempt in range(MAX_ATTEMPTS):
            assert wait_for(lambda: len(engine.submitted) == 2 + attempt)  # noqa: B023 - waited for here
            engine.lose(engine.submitted[-1])
        assert wait_for(lambda: len(outbox.answered) == 2)
    finally:
        gens.stop(2.0)
    choice = orjson.loads(cancelled.reply_value)["choices"][0]
    assert (choice["finish_reason"], choice["message"]["content"]) == ("cancelled", "so far")
    assert doomed.error is not None and doomed.dead_letter and f"lost {MAX_ATTEMPTS} times" in doomed.error.message
    assert len(engine.submitted) == 1 + MAX_ATTEMPTS


def test_read_cancel() -> None:
    from kinference.consumer.path.control import read_cancel

    assert read_cancel(b'{"cancel": "abc"}') == "abc"
    for bad in (b"", b"nope", b'{"cancel": 3}', b'["abc"]', b'{"cancel": ""}'):
        assert read_cancel(bad) is None


def test_a_deadline_that_passes_while_the_request_waits_is_answered_then_never_generated(
        engine: ScriptedEngine) -> None:
    """Issue 36: a request waiting for a place in the engine was sent to it after its deadline, and ended
    ``finish_reason: deadline``. It is answered ``deadline_exceeded`` at its deadline, and never generated; one
    that comes expired is answered at once."""
    outbox = Outbox()
    gens = generations(engine, outbox, max_sequences=1)
    running = request()
    deadline_ms = int(time.time() * 1000) + 300
    waiting, expired = request(deadline_ms=deadline_ms), request(deadline_ms=int(time.time() * 1000) - 1)
    gens.put([running])
    gens.put([waiting])
    gens.put([expired])
    assert outbox.answered == [expired] and expired.error.code == ErrorCode.DEADLINE_EXCEEDED
    gens.start()
    try:
        assert wait_for(lambda: waiting in outbox.answered, timeout_s=10)
        late_ms = time.time() * 1000 - deadline_ms
        engine.step(engine.submitted[0], "done", final=True)
        assert wait_for(lambda: running in outbox.answered)
        time.sleep(0.1)  # the freed place: nothing waits for it
    finally:
        gens.stop(2.0)
    assert 0 <= late_ms < 500, late_ms
    assert waiting.error is not None and waiting.error.code == ErrorCode.DEADLINE_EXCEEDED
    assert not waiting.dead_letter and waiting.reply_value is None
    assert len(engine.submitted) == 1 and gens.waiting == 0


class FailingEngine(ScriptedEngine):
    """Its ``events`` raises once ``fail`` is set (and clears it): the events of that call are lost."""

    def __init__(self) -> None:
        super().__init__()
        self.fail = threading.Event()
        self.engine_health = SERVING

    def events(self, timeout_s: float) -> list[Event]:
        if self.fail.is_set():
            self.fail.clear()
            raise RuntimeError("the engine broke")
        return super().events(timeout_s)

    @property
    def health(self) -> EngineHealth:
        return self.engine_health


def test_an_engine_whose_events_raise_fails_what_it_held_and_the_drain_goes_on() -> None:
    engine = FailingEngine()
    outbox = Outbox()
    gens = generations(engine, outbox)
    held = [request(), request(partition=1)]
    for req in held:
        gens.put([req])
    gens.start()
    try:
        engine.fail.set()
        assert wait_for(lambda: len(outbox.answered) == 2)
        assert gens.healthy
        after = request()
        gens.put([after])
        engine.step(engine.submitted[-1], "fine", final=True)
        assert wait_for(lambda: after in outbox.answered)
    finally:
        gens.stop(2.0)
    for req in held:
        assert req.error is not None and req.error.code == ErrorCode.HANDLER_ERROR
        assert "the engine broke" in req.error.message
    assert sorted(engine.cancelled) == sorted(engine.submitted[:2])
    assert orjson.loads(after.reply_value)["choices"][0]["message"]["content"] == "fine"


def test_the_model_is_unhealthy_while_its_engine_is_replaced_and_says_so() -> None:
    engine = FailingEngine()
    gens = generations(engine, Outbox())
    gens.start()
    try:
        assert gens.healthy and not gens.replacing and gens.stuck is None
        engine.engine_health = EngineHealth("model lm: the generation engine is being replaced: hung", replacing=True)
        assert not gens.healthy and gens.replacing and gens.stuck == engine.engine_health.problem
        engine.engine_health = EngineHealth("model lm: the generation engine gave up")
        assert not gens.healthy and not gens.replacing and "gave up" in (gens.stuck or "")
    finally:
        gens.stop(2.0)
