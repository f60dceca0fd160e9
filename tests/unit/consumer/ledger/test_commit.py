import random
import threading

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from kinference.consumer.ledger.commit import OffsetTracker
from kinference.consumer.ledger.commits import OffsetCommits
from kinference.consumer.ops.metrics import Metrics
from tests.fakes import make_request

P0 = ("requests", 0)


def positions(tracker):
    return {(tp.topic, tp.partition): tp.offset for tp in tracker.commit_offsets()}


def track(tracker: OffsetTracker, request) -> bool:
    """What the poll loop does with each record before anything else: register it, and keep its ledger."""
    request.ledger = tracker.track((request.topic, request.partition), request.offset)
    return request.ledger is not None


def test_commit_position_waits_for_the_lowest_unfinished_offset():
    tracker = OffsetTracker()
    tracker.assign([P0])
    requests = [make_request(offset=o) for o in range(10, 15)]
    for request in requests:
        track(tracker, request)
    assert positions(tracker) == {}
    for request in (requests[1], requests[2], requests[4]):
        tracker.finish([request])
    assert positions(tracker) == {}  # offset 10 is still unanswered
    tracker.finish([requests[0]])
    assert positions(tracker) == {P0: 13}  # 10..12 done, 13 pending
    tracker.finish([requests[3]])
    assert positions(tracker) == {P0: 15}
    assert tracker.in_flight == 0


def test_out_of_order_completion_random_orders():
    rng = random.Random(7)
    for _ in range(50):
        tracker = OffsetTracker()
        tracker.assign([P0])
        requests = [make_request(offset=o) for o in range(100)]
        for request in requests:
            track(tracker, request)
        order = requests[:]
        rng.shuffle(order)
        finished = set()
        for request in order:
            tracker.finish([request])
            finished.add(request.offset)
            expected = next(o for o in range(101) if o not in finished)
            assert positions(tracker).get(P0) == (expected if expected > 0 else None)
        assert tracker.in_flight == 0


def test_committed_offsets_are_not_returned_again():
    tracker = OffsetTracker()
    tracker.assign([P0])
    request = make_request(offset=0)
    track(tracker, request)
    tracker.finish([request])
    offsets = tracker.commit_offsets()
    tracker.committed(offsets)
    assert tracker.commit_offsets() == []


def test_revoked_partition_ignores_late_acknowledgements():
    tracker = OffsetTracker()
    tracker.assign([P0])
    request = make_request(offset=0)
    track(tracker, request)
    tracker.revoke([P0])
    tracker.finish([request])  # the reply landed after the partition moved to another member
    assert tracker.commit_offsets() == []
    tracker.assign([P0])  # re-assigned: a fresh ledger, the old request changes nothing
    assert tracker.commit_offsets() == [] and tracker.in_flight == 0


def test_abandoned_requests_leave_in_flight_but_block_the_commit_position():
    tracker = OffsetTracker()
    tracker.assign([P0])
    done, dropped, after = (make_request(offset=o) for o in range(3))
    for request in (done, dropped, after):
        track(tracker, request)
    tracker.abandon([dropped])
    tracker.finish([done])
    tracker.finish([after])
    assert tracker.in_flight == 0
    assert tracker.wait_idle(0.01, [P0])
    assert positions(tracker) == {P0: 1}  # never past the abandoned offset 1


def test_wait_idle_returns_when_the_last_request_finishes():
    tracker = OffsetTracker()
    tracker.assign([P0])
    request = make_request(offset=0)
    track(tracker, request)
    assert not tracker.wait_idle(0.02)
    timer = threading.Timer(0.05, tracker.finish, args=([request],))
    timer.start()
    assert tracker.wait_idle(5.0)


def test_partitions_are_independent():
    tracker = OffsetTracker()
    tracker.assign([P0, ("requests", 1)])
    a, b = make_request(partition=0, offset=5), make_request(partition=1, offset=7)
    track(tracker, a)
    track(tracker, b)
    tracker.finish([b])
    assert positions(tracker) == {("requests", 1): 8}
    assert tracker.wait_idle(0.01, [("requests", 1)]) and not tracker.wait_idle(0.01, [P0])
    assert tracker.wait_idle(0.0, [])  # a cooperative revoke of no partition waits for none


def test_records_of_partitions_not_assigned_are_refused():
    tracker = OffsetTracker()
    tracker.assign([P0])
    stray = make_request(partition=7, offset=3)
    assert track(tracker, stray) is False and stray.ledger is None
    tracker.revoke([P0])
    late = make_request(offset=4)  # fetched before the revoke, returned after it
    assert track(tracker, late) is False
    assert tracker.in_flight == 0 and tracker.commit_offsets() == []


def test_a_consumer_that_went_back_restarts_the_ledger_instead_of_skipping_the_records(caplog):
    """Issue 20 (also check): a backwards reset (a truncated log, auto.offset.reset after an out-of-range offset)
    was taken for redeliveries: every record up to the last tracked offset was dropped, never served."""
    tracker = OffsetTracker()
    tracker.assign([P0])
    old = [make_request(offset=offset) for offset in (100, 101)]
    for request in old:
        track(tracker, request)
    tracker.finish(old[:1])
    assert positions(tracker) == {P0: 101}
    tracker.committed(tracker.commit_offsets())
    again = [make_request(offset=offset) for offset in (50, 51)]
    assert all(track(tracker, request) for request in again)
    assert "went back from offset 101 to 50" in caplog.text
    assert tracker.in_flight == 2  # the new ledger's; the old one's late answer moves nothing
    tracker.finish([*again, old[1]])
    assert positions(tracker) == {P0: 52} and tracker.in_flight == 0


def test_offsets_never_handed_over_are_committed_across_and_an_unanswered_record_never():
    """Issue 29: transaction markers, aborted records (read_committed) and compaction leave gaps in the offsets.
    The ledger commits across them, between tracked records and after the last one (the consumer's position),
    and never past a record it was handed and that is not answered."""
    tracker = OffsetTracker()
    tracker.assign([P0])
    first, after_gap, later = (make_request(offset=offset) for offset in (10, 16, 17))
    for request in (first, after_gap, later):
        track(tracker, request)
    tracker.passed([(P0, 20)])  # 18 and 19: a marker and a compacted record after the last record handed over
    assert positions(tracker) == {}  # nothing answered yet
    tracker.finish([later])
    assert positions(tracker) == {}, "offset 10 is unanswered: nothing past it"
    tracker.finish([first])
    assert positions(tracker) == {P0: 16}, "11-15 were never handed over; 16 is the first unanswered record"
    tracker.finish([after_gap])
    assert positions(tracker) == {P0: 20}
    tracker.committed(tracker.commit_offsets())
    tracker.passed([(P0, 22)])  # a transaction's marker, fetched on its own after the records
    assert positions(tracker) == {P0: 22}


def test_a_position_behind_the_last_tracked_record_moves_nothing():
    """A position read before a record of the same fetch was handed over, or after a reset, is no gap."""
    tracker = OffsetTracker()
    tracker.assign([P0])
    request = make_request(offset=5)
    track(tracker, request)
    tracker.passed([(P0, 3), (("other", 0), 9)])  # and a partition not assigned is ignored
    tracker.finish([request])
    assert positions(tracker) == {P0: 6}


class FakeConsumer:
    def __init__(self, fail_sync: bool = False):
        self.commits: list[tuple[list, bool]] = []
        self.fail_sync = fail_sync

    def commit(self, offsets, asynchronous):
        self.commits.append(([(tp.topic, tp.partition, tp.offset) for tp in offsets], asynchronous))
        if not asynchronous:
            if self.fail_sync:
                raise KafkaException(KafkaError(KafkaError.REQUEST_TIMED_OUT))
            return offsets
        return None


def answered_once() -> tuple[OffsetCommits, OffsetTracker, Metrics]:
    """A committer whose tracker has one answered record at offset 0 of P0."""
    tracker, metrics = OffsetTracker(), Metrics()
    tracker.assign([P0])
    request = make_request(offset=0)
    track(tracker, request)
    tracker.finish([request])
    return OffsetCommits(tracker, metrics, interval_s=1.0), tracker, metrics


def test_committer_commits_asynchronously_on_its_interval_and_learns_from_the_report():
    committer, _, metrics = answered_once()
    consumer = FakeConsumer()
    committer.turn(consumer, now=100.0)
    committer.turn(consumer, now=100.5)  # within the interval: nothing
    assert consumer.commits == [([("requests", 0, 1)], True)]
    committer.turn(consumer, now=101.5)  # the first is not reported yet: commits never pile up
    assert len(consumer.commits) == 1
    committer.on_commit(None, [TopicPartition("requests", 0, 1)])
    committer.turn(consumer, now=103.0)  # confirmed: nothing new to commit
    assert len(consumer.commits) == 1 and metrics.commits._value.get() == 1


def test_committer_counts_a_failed_commit_and_retries_later():
    committer, tracker, metrics = answered_once()
    committer.on_commit(KafkaError(KafkaError.REBALANCE_IN_PROGRESS), [TopicPartition("requests", 0, 1)])
    committer.commit(FakeConsumer(fail_sync=True), [P0])
    assert metrics.commit_failures._value.get() == 2
    consumer = FakeConsumer()
    committer.commit(consumer, [P0])  # revoke: synchronous
    assert consumer.commits == [([("requests", 0, 1)], False)] and tracker.commit_offsets() == []


def test_a_fetch_is_tracked_in_one_call_each_record_with_its_own_ledger(caplog):
    """The intake tracks a whole fetch at once (issue 38): records of an unowned partition get no ledger, and a
    consumer that went back within the fetch restarts its partition's ledger from that record on."""
    tracker = OffsetTracker()
    tracker.assign([P0, ("requests", 1)])
    fetch = [make_request(offset=10), make_request(offset=11), make_request(partition=2, offset=5),
             make_request(partition=1, offset=7), make_request(offset=3), make_request(offset=4)]
    ledgers = tracker.track_fetch([((request.topic, request.partition), request.offset) for request in fetch])
    for request, ledger in zip(fetch, ledgers, strict=True):
        request.ledger = ledger
    assert ledgers[2] is None, "partition 2 is not this member's"
    assert ledgers[0] is ledgers[1] and ledgers[4] is ledgers[5] and ledgers[0] is not ledgers[4]
    assert not ledgers[0].attached and "went back from offset 11 to 3" in caplog.text
    assert tracker.in_flight == 3  # partition 1's record, and the restarted ledger's two
    tracker.finish([fetch[0], fetch[1], fetch[4]])
    assert positions(tracker) == {P0: 4}, "the detached ledger's answers move nothing; 4 is unanswered"
    tracker.finish([fetch[5], fetch[3]])
    assert positions(tracker) == {P0: 5, ("requests", 1): 8} and tracker.in_flight == 0


def test_runs_of_answers_in_any_order_and_any_grouping_move_the_position_as_one_by_one_would():
    """Issue 38: the ledger finishes a batch of offsets in one call (a run at its head in one step). Whatever the
    order and grouping of the answers, over two partitions, gaps and more offsets than it compacts at, the position
    is always the first tracked offset not answered, and the in-flight count what is left."""
    rng = random.Random(38)
    p1 = ("requests", 1)
    tracker = OffsetTracker()
    tracker.assign([P0, p1])
    offsets = sorted(rng.sample(range(12_000), 9_000))  # gaps: offsets never handed over
    requests = [make_request(partition=partition, offset=offset) for offset in offsets for partition in (0, 1)]
    for request in requests:
        track(tracker, request)
    answered: set[tuple[int, int]] = set()
    # Mostly in order, in runs of up to 64, with some answers held back and given late.
    pending = list(requests)
    held_back: list = []
    while pending or held_back:
        size = rng.randint(1, 64)
        batch, pending = pending[:size], pending[size:]
        if rng.random() < 0.3 and batch:
            held_back.append(batch.pop(rng.randrange(len(batch))))
        if held_back and (rng.random() < 0.2 or not pending):
            late = rng.randint(1, len(held_back))
            batch, held_back = batch + held_back[:late], held_back[late:]
        rng.shuffle(batch)
        tracker.finish(batch)
        answered.update((request.partition, request.offset) for request in batch)
        for partition in (0, 1):
            left = [offset for offset in offsets if (partition, offset) not in answered]
            position = positions(tracker).get(("requests", partition))
            if left and left[0] != offsets[0]:
                assert position == left[0]
            elif left:
                assert position is None
        assert tracker.in_flight == 2 * len(offsets) - len(answered)
    tracker.passed([(P0, 12_000), (p1, 12_000)])
    assert positions(tracker) == {P0: 12_000, p1: 12_000} and tracker.in_flight == 0
