"""Reading reply records: status, result, error code and the server-side timings."""

from __future__ import annotations

import orjson
import pytest

from kinference import protocol
from kinference.loadgen.errors import ReplyError
from kinference.loadgen.reply import Reply
from tests.fakes import FakeRecord


def reply(value: bytes, headers: list) -> Reply:
    return Reply.from_record(FakeRecord(value, headers, key=b"k"), sent_at=1.0, received_at=1.25)


def test_ok_reply_carries_result_and_timings():
    r = reply(orjson.dumps({"result": {"x": 1}}), [
        (protocol.CORRELATION_ID, b"c1"), (protocol.STATUS, b"ok"), (protocol.QUEUE_MS, b"1.5"),
        (protocol.BATCH_SIZE, b"8"), (protocol.INFERENCE_MS, b"12.250"), (protocol.SERVICE_MS, b"20.000")])
    assert r.ok and r.error_code is None
    assert r.result() == {"x": 1}
    assert (r.correlation_id, r.key, r.latency_s) == ("c1", b"k", 0.25)
    assert (r.queue_ms, r.batch_size, r.inference_ms, r.service_ms) == (1.5, 8, 12.25, 20.0)


def test_error_reply_raises_reply_error_with_code_and_message():
    r = reply(orjson.dumps({"error": {"code": "bad_request", "message": "not JSON"}}),
              [(protocol.STATUS, b"error"), (protocol.ERROR_CODE, b"bad_request")])
    assert not r.ok and r.error_code == "bad_request"
    with pytest.raises(ReplyError) as caught:
        r.result()
    assert (caught.value.code, caught.value.message, caught.value.reply) == ("bad_request", "not JSON", r)
    assert r.queue_ms is None and r.batch_size is None, "no timings for requests never batched"


def test_error_code_falls_back_to_the_body_without_the_header():
    r = reply(orjson.dumps({"error": {"code": "deadline_exceeded", "message": "late"}}),
              [(protocol.STATUS, b"error")])
    assert r.error_code == "deadline_exceeded"
