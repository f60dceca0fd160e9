"""The in-flight byte budget (issue 29, item 5): requests are counted by what they hold decoded, and the partitions
pause on bytes as they do on the count."""

from __future__ import annotations

import orjson

from kinference.consumer.ledger.budget import ByteBudget
from kinference.consumer.ledger.commit import OffsetTracker
from kinference.consumer.ops.metrics import Metrics
from kinference.consumer.path.flow import FlowControl
from kinference.consumer.path.intake import Intake
from kinference.consumer.path.request import RequestDecoder
from kinference.consumer.wire import jsonscan
from tests.fakes import FakeModels, FakeRecord

DECODER = RequestDecoder("replies", max_request_bytes=1_000_000, payload_format="json")


def strings_value(size: int) -> bytes:
    """The issue's shape: an array of two-character strings (959 KB held ~14 MB decoded)."""
    return b"[" + b",".join([b'"ab"'] * (size // 5)) + b"]"


def test_a_request_is_charged_what_its_value_holds_decoded_not_its_size():
    small = DECODER.decode(FakeRecord(b'{"text": "hello"}'))
    wide = DECODER.decode(FakeRecord(strings_value(959_000)))
    assert small.held_bytes <= 256 + 40 * 17  # a small value is charged the worst ratio, uncounted (issue 27)
    # Decoded it holds ~12x its bytes as Python objects: the charge is at least that, and not wildly more.
    assert 12 * 959_000 <= wide.held_bytes <= 25 * 959_000
    raw = RequestDecoder("replies", 1_000_000, payload_format="bytes").decode(FakeRecord(strings_value(959_000)))
    assert raw.held_bytes == len(raw.value)  # a bytes handler gets the value itself
    unreadable = DECODER.decode(FakeRecord(b"[not json"))
    assert unreadable.held_bytes == len(b"[not json")


def test_the_estimate_is_never_below_what_a_value_holds(monkeypatch):
    import tracemalloc

    for value in (strings_value(100_000), b"[" + b",".join([b"[]"] * 30_000) + b"]",
                  orjson.dumps([{"a": 1.5, "b": "x"}] * 3000), orjson.dumps({"t": "h\u00e9llo \U0001f600" * 5000}),
                  orjson.dumps({f"k{i}": [i] for i in range(5000)})):
        tracemalloc.start()
        decoded = orjson.loads(value)
        held = tracemalloc.get_traced_memory()[0] + len(value)
        tracemalloc.stop()
        del decoded
        assert held <= jsonscan.decoded_bytes(value) <= 5 * held, value[:40]


def test_charge_and_release_count_each_request_once_and_never_write_it():
    """Issue 37: the budget keeps what it charged; the runner lets the payload go (``test_stages``)."""
    budget = ByteBudget(max_bytes=10_000_000)
    requests = [DECODER.decode(FakeRecord(strings_value(100_000))) for _ in range(3)]
    sizes = [request.held_bytes for request in requests]
    budget.charge(requests)
    assert budget.held == sum(sizes) > 3 * 1_000_000
    budget.release(requests[:1])
    budget.release(requests[:1])  # again: nothing more
    assert budget.held == sizes[1] + sizes[2]
    assert [request.held_bytes for request in requests] == sizes and requests[0].payload is not None
    budget.release(requests)
    assert budget.held == 0
    budget.release([DECODER.decode(FakeRecord(b'{"never": "charged"}'))])
    assert budget.held == 0


def test_a_poll_takes_fewer_records_as_the_budget_fills_and_always_one():
    budget = ByteBudget(max_bytes=20_000_000)
    assert budget.records_allowed(500) == 1  # nothing seen yet: one record tells what records hold
    budget.charge([DECODER.decode(FakeRecord(b'{"text": "hi"}'))])
    assert budget.records_allowed(500) == 500
    requests = [DECODER.decode(FakeRecord(strings_value(100_000))) for _ in range(4)]
    budget.charge(requests)  # larger records: planned for at once
    assert budget.records_allowed(500) == (20_000_000 - budget.held) // requests[0].held_bytes == 5
    budget.charge([DECODER.decode(FakeRecord(strings_value(959_000))) for _ in range(2)])
    assert budget.held > budget.max_bytes and budget.records_allowed(500) == 1


class Consumer:
    def __init__(self) -> None:
        self.paused = self.resumed = 0

    def assignment(self) -> list:
        return []

    def pause(self, _partitions) -> None:
        self.paused += 1

    def resume(self, _partitions) -> None:
        self.resumed += 1

    def position(self, partitions) -> list:
        return partitions


def test_partitions_pause_on_bytes_below_the_count_and_resume_at_half():
    requests = [DECODER.decode(FakeRecord(strings_value(959_000))) for _ in range(3)]  # ~14 MB each decoded
    budget = ByteBudget(max_bytes=int(2.2 * requests[0].held_bytes))
    flow = FlowControl(max_in_flight=2048, resume_in_flight=1024, metrics=Metrics(), budget=budget)
    consumer = Consumer()
    budget.charge(requests[:1])
    flow.update(consumer, in_flight=1)
    assert not flow.paused
    budget.charge(requests[1:])
    flow.update(consumer, in_flight=3)  # 3 of 2048 requests, but over the bytes
    assert flow.paused and consumer.paused == 1
    budget.release(requests[:1])
    flow.update(consumer, in_flight=2)
    assert flow.paused  # above half the budget still
    budget.release(requests[1:2])
    flow.update(consumer, in_flight=1)
    assert not flow.paused and consumer.resumed == 1


def test_partitions_pause_before_a_record_of_the_size_seen_would_carry_the_bytes_past_the_budget():
    """Issue 36: large Schema Registry records, one a poll, each took the service past its budget by one record; the
    pause comes while one more would not fit, and never while nothing is held (a record larger than the whole
    budget is still served, alone)."""
    requests = [DECODER.decode(FakeRecord(strings_value(959_000))) for _ in range(2)]
    budget = ByteBudget(max_bytes=int(1.5 * requests[0].held_bytes))
    flow = FlowControl(max_in_flight=2048, resume_in_flight=1024, metrics=Metrics(), budget=budget)
    consumer = Consumer()
    assert not budget.full()
    budget.charge(requests[:1])  # 1 of 1.5 records' worth held: the next would pass the bound
    assert budget.full()
    flow.update(consumer, in_flight=1)
    assert flow.paused and consumer.paused == 1
    budget.release(requests[:1])
    flow.update(consumer, in_flight=0)
    assert not flow.paused and not budget.full()
    alone = ByteBudget(max_bytes=requests[1].held_bytes // 2)
    assert not alone.full() and alone.records_allowed(500) == 1  # larger than the whole budget: still taken alone


class Consumed(FakeRecord):
    """A record as ``consume()`` hands it over: no error."""

    def error(self):
        return None


def test_a_fetch_is_decoded_only_while_the_budget_has_room_and_the_rest_waits_tracked():
    """Issue 36: a fetch of records that each hold most of the budget once decoded took the service past it (two
    900 KB Avro records of 180 MB each under 256 MiB, in one fetch). A record is decoded only while there is room for
    one more like the last; the others wait raw and tracked (the commit never passes them), decoded first as answers
    give bytes back; one is decoded while nothing is held (a record larger than the budget is served alone)."""
    size = DECODER.decode(Consumed(strings_value(959_000))).held_bytes
    tracker, models = OffsetTracker(), FakeModels()
    tracker.assign([("requests", 0)])
    budget = ByteBudget(max_bytes=int(1.5 * size))
    intake = Intake(DECODER, tracker, models, budget=budget)
    intake.take([Consumed(strings_value(959_000), partition=0, offset=i) for i in range(3)], on_error=print)
    assert len(models.admitted) == 1 and intake.waiting == 2 and budget.held == size
    assert tracker.in_flight == 3  # all tracked: no commit passes the waiting two
    intake.take([], on_error=print)  # nothing given back yet: nothing more decoded
    assert len(models.admitted) == 1 and intake.waiting == 2
    budget.release(models.admitted[:1])
    intake.take([Consumed(b'{"text": "later"}', partition=0, offset=3)], on_error=print)
    assert [request.offset for request in models.admitted] == [0, 1]  # in order, the fetch's records first
    assert intake.waiting == 2 and budget.held <= budget.max_bytes
    taken_back = intake.discard([("requests", 0)])  # a revoke: the waiting records go back with the rest
    assert sorted(request.offset for request in taken_back) == [2, 3] and intake.waiting == 0
    assert all(request.ledger is not None for request in taken_back)
    alone_tracker = OffsetTracker()
    alone_tracker.assign([("requests", 0)])
    alone = Intake(DECODER, alone_tracker, FakeModels(), budget=ByteBudget(max_bytes=size // 2))
    alone.take([Consumed(strings_value(959_000), partition=0, offset=0)], on_error=print)
    assert alone.waiting == 0 and alone.budget.held == size  # larger than the whole budget: served, alone
