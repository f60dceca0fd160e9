"""Client.stream's ordering (loadgen/stream.py): duplicates dropped, a new attempt restarts, a gap raises."""

from __future__ import annotations

import queue
import time

import orjson
import pytest

from kinference.loadgen.errors import ReplyError, RequestTimeout
from kinference.loadgen.stream import Stream, StreamGap
from kinference.protocol import ATTEMPT, CORRELATION_ID, EVENT, SEQUENCE, STATUS, encode_error
from tests.fakes import FakeRecord


def chunk(attempt: str, sequence: int, text: str) -> FakeRecord:
    value = orjson.dumps({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}]})
    return FakeRecord(value, [(CORRELATION_ID, b"c"), (EVENT, b"delta"), (SEQUENCE, str(sequence).encode()),
                              (ATTEMPT, attempt.encode())])


def final(attempt: str, sequence: int, text: str) -> FakeRecord:
    value = orjson.dumps({"object": "chat.completion", "choices": [{"index": 0, "message": {"content": text}}]})
    return FakeRecord(value, [(CORRELATION_ID, b"c"), (STATUS, b"ok"), (EVENT, b"final"),
                              (SEQUENCE, str(sequence).encode()), (ATTEMPT, attempt.encode())])


def stream_of(*records: FakeRecord, timeout_s: float = 5.0) -> Stream:
    inbox: queue.Queue = queue.Queue()
    for record in records:
        inbox.put((record, time.monotonic()))
    return Stream(inbox, time.monotonic() + timeout_s, "c", time.monotonic(), lambda: None)


def test_duplicates_are_dropped_and_the_completion_kept() -> None:
    stream = stream_of(chunk("a", 0, "he"), chunk("a", 1, "llo"), chunk("a", 1, "llo"), chunk("a", 0, "he"),
                       final("a", 2, "hello"))
    assert [delta.text for delta in stream] == ["he", "llo"]
    assert stream.completion is not None and stream.completion["choices"][0]["message"]["content"] == "hello"


def test_a_new_attempt_restarts_and_the_abandoned_one_is_dropped() -> None:
    stream = stream_of(chunk("a", 0, "he"), chunk("b", 0, "hi"), chunk("a", 1, "llo"), chunk("b", 1, " there"),
                       final("a", 2, "hello"), final("b", 2, "hi there"))
    deltas = list(stream)
    assert [(delta.text, delta.restart) for delta in deltas] == [("he", False), ("hi", True), (" there", False)]
    assert stream.completion["choices"][0]["message"]["content"] == "hi there"


def test_a_gap_raises() -> None:
    with pytest.raises(StreamGap, match="chunk 1 of c is missing"):
        list(stream_of(chunk("a", 0, "he"), chunk("a", 2, "lo")))


def test_a_final_without_chunks_is_one_delta() -> None:
    stream = stream_of(final("a", 0, "all at once"))
    assert [delta.text for delta in stream] == ["all at once"]


def test_an_error_reply_raises_reply_error_and_silence_times_out() -> None:
    error = FakeRecord(encode_error("bad_request", "no"), [(CORRELATION_ID, b"c"), (STATUS, b"error"),
                                                           ("kinference-error-code", b"bad_request")])
    with pytest.raises(ReplyError, match="bad_request"):
        list(stream_of(error))
    with pytest.raises(RequestTimeout):
        list(stream_of(chunk("a", 0, "x"), timeout_s=0.2))


def test_async_for_reads_an_asyncio_queue_and_each_delta_keeps_its_arrival_time() -> None:
    import asyncio

    async def read() -> tuple[list, Stream]:
        inbox: asyncio.Queue = asyncio.Queue()
        for at, record in ((1.0, chunk("a", 0, "he")), (2.0, chunk("a", 1, "llo")), (3.0, final("a", 2, "hello"))):
            inbox.put_nowait((record, at))
        stream = Stream(inbox, time.monotonic() + 5, "c", 0.0, lambda: None)
        return [delta async for delta in stream], stream

    deltas, stream = asyncio.run(read())
    assert [(delta.text, delta.received_at) for delta in deltas] == [("he", 1.0), ("llo", 2.0)]
    assert stream.completed_at == 3.0
    with pytest.raises(TypeError, match="async for"):
        list(stream)


def test_async_for_times_out_without_a_final() -> None:
    import asyncio

    forgotten = []

    async def read() -> None:
        stream = Stream(asyncio.Queue(), time.monotonic() + 0.05, "c", 0.0, lambda: forgotten.append(True))
        async for _ in stream:
            pass

    with pytest.raises(RequestTimeout):
        asyncio.run(read())
    assert forgotten == [True]
