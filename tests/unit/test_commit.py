import random
import threading

from kinference.consumer.commit import OffsetTracker
from tests.fakes import make_request

P0 = ("requests", 0)


def positions(tracker):
    return {(tp.topic, tp.partition): tp.offset for tp in tracker.commit_offsets()}


def test_commit_position_waits_for_the_lowest_unfinished_offset():
    tracker = OffsetTracker()
    tracker.assign([P0])
    requests = [make_request(offset=o) for o in range(10, 15)]
    for request in requests:
        tracker.track(request)
    assert positions(tracker) == {}
    for request in (requests[1], requests[2], requests[4]):
        tracker.finish(request)
    assert positions(tracker) == {}  # offset 10 is still unanswered
    tracker.finish(requests[0])
    assert positions(tracker) == {P0: 13}  # 10..12 done, 13 pending
    tracker.finish(requests[3])
    assert positions(tracker) == {P0: 15}
    assert tracker.in_flight == 0


def test_out_of_order_completion_random_orders():
    rng = random.Random(7)
    for _ in range(50):
        tracker = OffsetTracker()
        tracker.assign([P0])
        requests = [make_request(offset=o) for o in range(100)]
        for request in requests:
            tracker.track(request)
        order = requests[:]
        rng.shuffle(order)
        finished = set()
        for request in order:
            tracker.finish(request)
            finished.add(request.offset)
            expected = next(o for o in range(101) if o not in finished)
            assert positions(tracker).get(P0) == (expected if expected > 0 else None)
        assert tracker.in_flight == 0


def test_committed_offsets_are_not_returned_again():
    tracker = OffsetTracker()
    tracker.assign([P0])
    request = make_request(offset=0)
    tracker.track(request)
    tracker.finish(request)
    offsets = tracker.commit_offsets()
    tracker.committed(offsets)
    assert tracker.commit_offsets() == []


def test_revoked_partition_ignores_late_acknowledgements():
    tracker = OffsetTracker()
    tracker.assign([P0])
    request = make_request(offset=0)
    tracker.track(request)
    tracker.revoke([P0])
    tracker.finish(request)  # the reply landed after the partition moved to another member
    assert tracker.commit_offsets() == []
    tracker.assign([P0])  # re-assigned: a fresh ledger, the old request changes nothing
    assert tracker.commit_offsets() == [] and tracker.in_flight == 0


def test_abandoned_requests_leave_in_flight_but_block_the_commit_position():
    tracker = OffsetTracker()
    tracker.assign([P0])
    done, dropped, after = (make_request(offset=o) for o in range(3))
    for request in (done, dropped, after):
        tracker.track(request)
    tracker.abandon([dropped])
    tracker.finish(done)
    tracker.finish(after)
    assert tracker.in_flight == 0
    assert tracker.wait_idle(0.01, [P0])
    assert positions(tracker) == {P0: 1}  # never past the abandoned offset 1


def test_wait_idle_returns_when_the_last_request_finishes():
    tracker = OffsetTracker()
    tracker.assign([P0])
    request = make_request(offset=0)
    tracker.track(request)
    assert not tracker.wait_idle(0.02)
    timer = threading.Timer(0.05, tracker.finish, args=(request,))
    timer.start()
    assert tracker.wait_idle(5.0)


def test_partitions_are_independent():
    tracker = OffsetTracker()
    tracker.assign([P0, ("requests", 1)])
    a, b = make_request(partition=0, offset=5), make_request(partition=1, offset=7)
    tracker.track(a)
    tracker.track(b)
    tracker.finish(b)
    assert positions(tracker) == {("requests", 1): 8}
    assert tracker.wait_idle(0.01, [("requests", 1)]) and not tracker.wait_idle(0.01, [P0])


def test_records_of_partitions_not_assigned_are_refused():
    tracker = OffsetTracker()
    tracker.assign([P0])
    stray = make_request(partition=7, offset=3)
    assert tracker.track(stray) is False and stray.ledger is None
    tracker.revoke([P0])
    late = make_request(offset=4)  # fetched before the revoke, returned after it
    assert tracker.track(late) is False
    assert tracker.in_flight == 0 and tracker.commit_offsets() == []


def test_a_record_consumed_twice_in_one_assignment_is_tracked_once():
    tracker = OffsetTracker()
    tracker.assign([P0])
    first, again = make_request(offset=5), make_request(offset=5)
    assert tracker.track(first) and not tracker.track(again)
    tracker.finish(first)
    assert positions(tracker) == {P0: 6} and tracker.in_flight == 0
