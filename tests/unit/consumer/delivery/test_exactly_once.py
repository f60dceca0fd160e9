"""Exactly-once's transactional contract (``exactly_once``, and its poll-thread side ``ledger.commits``), through the
publisher, with a fake transactional producer (pure logic). What both delivery modes share is tested in
``test_publisher``."""

from __future__ import annotations

from confluent_kafka import KafkaError, KafkaException

from kinference.consumer.delivery.exactly_once import ABORTS_BEFORE_UNHEALTHY, ExactlyOnce
from kinference.consumer.delivery.member_slot import MemberSlot
from kinference.consumer.delivery.publisher import Publisher, PublishSettings
from kinference.consumer.ledger.commit import OffsetTracker
from kinference.consumer.ledger.commits import TransactionCommits, Transactions
from kinference.consumer.ops.metrics import Metrics
from kinference.protocol import encode_result
from tests.fakes import FakeProducer, make_request, wait_for

P0 = ("requests", 0)


def retriable(code=KafkaError._TIMED_OUT):
    return KafkaException(KafkaError(code, "try again", retriable=True))


def abortable(code=KafkaError.INVALID_PRODUCER_EPOCH):
    return KafkaException(KafkaError(code, "abort it", txn_requires_abort=True))


def fatal(code=KafkaError._FENCED):
    return KafkaException(KafkaError(code, "fenced", fatal=True))


def new_checkpoint(tracker: OffsetTracker, transactions: Transactions | None = None) -> ExactlyOnce:
    """Exactly-once's publisher side, on ``transactions`` (shared with its poll side) or on its own."""
    return ExactlyOnce(tracker, transactions or Transactions(), "dead", metrics=Metrics(), commit_interval_s=0.05)


def publisher_with(tracker: OffsetTracker, failures=None, checkpoint: ExactlyOnce | None = None,
                   **options) -> tuple[Publisher, FakeProducer]:
    """A started publisher with exactly-once, and its fake producer (``FakeProducer``'s options)."""
    checkpoint = checkpoint or new_checkpoint(tracker)
    FakeProducer.instances.clear()
    publisher = Publisher({"transactional.id": "tid"}, checkpoint, PublishSettings("dead", queue_size=100), Metrics(),
                          producer_factory=lambda config: FakeProducer(config, failures=failures, **options))
    publisher.start()
    assert wait_for(lambda: FakeProducer.instances)
    return publisher, FakeProducer.instances[0]


def tracked(tracker, offset, value=None, topic="requests"):
    request = make_request({"x": offset}, offset=offset, topic=topic)
    request.reply_value = encode_result(value if value is not None else {"x": offset})
    request.ledger = tracker.track((request.topic, request.partition), request.offset)
    return request



def new_tracker():
    tracker = OffsetTracker()
    tracker.assign([P0])
    return tracker


def test_replies_and_their_offsets_commit_together_in_offset_runs():
    tracker = new_tracker()
    transactions = Transactions()
    checkpoint, commits = new_checkpoint(tracker, transactions), TransactionCommits(tracker, transactions)
    publisher, producer = publisher_with(tracker, checkpoint=checkpoint)
    first, second, third = (tracked(tracker, offset) for offset in (0, 1, 2))
    publisher.submit([third, first])  # 1 missing: only offset 0 can commit
    assert wait_for(lambda: producer.committed)
    assert producer.committed[0][1] == [("requests", 0, 1)] and len(producer.committed[0][0]) == 1
    # third waits for second, and counts towards backpressure with it
    assert checkpoint.held == 1 and commits.in_flight == 2
    publisher.submit([second])
    assert wait_for(lambda: len(producer.committed) == 2)
    assert producer.committed[1][1] == [("requests", 0, 3)] and len(producer.committed[1][0]) == 2
    publisher.stop(5)
    assert commits.in_flight == 0 and publisher.failure is None


def test_a_retriable_commit_error_repeats_the_same_call_and_never_aborts():
    tracker = new_tracker()
    publisher, producer = publisher_with(tracker, {"commit": [retriable(), retriable(), None]})
    publisher.submit([tracked(tracker, 0)])
    assert wait_for(lambda: producer.committed)
    publisher.stop(5)
    assert "abort" not in producer.calls and producer.calls.count("begin") == 1
    assert producer.calls.count("commit") == 3 and len(producer.committed) == 1


def test_an_abortable_error_aborts_and_the_next_transaction_answers_the_same_requests():
    tracker = new_tracker()
    publisher, producer = publisher_with(tracker, {"send_offsets": [abortable(), None]})
    request = tracked(tracker, 0)
    publisher.submit([request])
    assert wait_for(lambda: producer.committed)
    publisher.stop(5)
    assert producer.calls[:4] == ["init", "begin", "send_offsets", "abort"]
    (records, offsets), = producer.committed
    assert [topic for topic, _ in records] == ["replies"] and offsets == [("requests", 0, 1)]


def test_a_reply_refused_for_good_is_replaced_by_a_dead_letter_in_the_next_transaction():
    tracker = new_tracker()
    unknown = KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART)
    publisher, producer = publisher_with(tracker, fate=lambda topic: unknown if topic == "nowhere" else None)
    lost, fine = tracked(tracker, 0), tracked(tracker, 1)
    lost.reply_topic = "nowhere"
    publisher.submit([lost, fine])
    assert wait_for(lambda: producer.committed)
    publisher.stop(5)
    assert "abort" in producer.calls
    (records, offsets), = producer.committed
    assert sorted(topic for topic, _ in records) == ["dead", "replies"] and offsets == [("requests", 0, 2)]


def test_a_record_that_only_timed_out_goes_into_the_next_transaction_unchanged():
    tracker = new_tracker()
    outcomes = iter([KafkaError(KafkaError._MSG_TIMED_OUT)])
    publisher, producer = publisher_with(tracker, fate=lambda topic: next(outcomes, None))
    publisher.submit([tracked(tracker, 0)])
    assert wait_for(lambda: producer.committed)
    publisher.stop(5)
    (records, _), = producer.committed
    assert [topic for topic, _ in records] == ["replies"]  # no dead letter for a passing failure


def test_a_fatal_error_stops_the_publisher_without_reinitialising():
    tracker = new_tracker()
    publisher, producer = publisher_with(tracker, {"commit": [fatal()]})
    publisher.submit([tracked(tracker, 0)])
    assert wait_for(lambda: not publisher.alive)
    assert publisher.failure is not None and "fenced" in publisher.failure
    assert producer.calls.count("init") == 1 and not producer.committed


def test_aborts_in_a_row_make_the_service_unhealthy():
    tracker = new_tracker()
    publisher, producer = publisher_with(tracker, {"send_offsets": [abortable()] * (ABORTS_BEFORE_UNHEALTHY + 5)})
    publisher.submit([tracked(tracker, 0)])
    assert wait_for(lambda: publisher.failure is not None)
    assert f"{ABORTS_BEFORE_UNHEALTHY} transactions in a row" in publisher.failure
    assert producer.calls.count("abort") == ABORTS_BEFORE_UNHEALTHY and not producer.committed
    publisher.stop(5)


def test_a_stale_request_of_a_revoked_assignment_never_replaces_the_new_one():
    """Revoked and handed back: a late copy from the old assignment arrives after the new one. Held replies are
    keyed by assignment, so the new request's reply is the one committed, and the stale one is dropped."""
    tracker = new_tracker()
    publisher, producer = publisher_with(tracker)
    stale = tracked(tracker, 0, value={"assignment": "old"})
    tracker.revoke([P0])
    tracker.assign([P0])
    fresh = tracked(tracker, 0, value={"assignment": "new"})
    publisher.submit([fresh, stale])
    assert wait_for(lambda: producer.committed)
    publisher.stop(5)
    (records, offsets), = producer.committed
    assert records == [("replies", encode_result({"assignment": "new"}))] and offsets == [("requests", 0, 1)]


class GroupConsumer:
    """A consumer's group generation, as the poll thread reads it; None: it has left the group and has none."""

    generation: str | None = "generation-1"

    def consumer_group_metadata(self):
        if self.generation is None:
            raise RuntimeError("Consumer group metadata not available")  # confluent-kafka's words, on a real close
        return self.generation


def test_the_poll_thread_reads_the_generation_that_fences_the_transaction_and_keeps_it_once_none_is_left():
    """KIP-447: each transaction carries the group generation the poll thread read last (the publisher thread cannot
    ask the consumer). A revoke while leaving the group finds none: it does not fail, and the last one stays."""
    tracker = new_tracker()
    transactions = Transactions()
    checkpoint = ExactlyOnce(tracker, transactions, "dead", metrics=Metrics(), commit_interval_s=0.05, timeout_s=0.05)
    commits = TransactionCommits(tracker, transactions, timeout_s=0.05)
    consumer = GroupConsumer()
    commits.turn(consumer, 0.0)
    consumer.generation = None
    commits.commit(consumer, [P0])  # no publisher yet: waits its 0.05 s for a transaction, and goes on
    publisher, producer = publisher_with(tracker, checkpoint=checkpoint)
    publisher.submit([tracked(tracker, 0)])
    assert wait_for(lambda: producer.committed)
    publisher.stop(5)
    assert producer.generation == "generation-1"


def test_member_slots_are_stable_per_host_and_distinct_between_live_members(tmp_path):
    first, second = MemberSlot("group/a", tmp_path), MemberSlot("group/a", tmp_path)
    assert (first.slot, second.slot) == (0, 1)
    assert first.transactional_id("group/a") != second.transactional_id("group/a")
    first.close()  # the member with slot 0 died: its successor gets the same slot, hence the same id
    successor = MemberSlot("group/a", tmp_path)
    assert successor.slot == 0
    other_group = MemberSlot("group-b", tmp_path)
    assert other_group.slot == 0
    for slot in (second, successor, other_group):
        slot.close()
