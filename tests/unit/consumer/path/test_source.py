"""The poll thread's pieces with a fake consumer (pure logic): intake, rebalances, flow control, fatal errors."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import pytest
from confluent_kafka import KafkaError, TopicPartition

from kinference.consumer.config import ServiceConfig
from kinference.consumer.ledger.commit import OffsetTracker
from kinference.consumer.ledger.commits import TransactionCommits, Transactions
from kinference.consumer.ops.metrics import Metrics
from kinference.consumer.path.flow import FlowControl
from kinference.consumer.path.intake import Intake
from kinference.consumer.path.request import RequestDecoder
from kinference.consumer.path.source import Source
from tests.fakes import FakeModels, FakeRecord


class FakeConsumer:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.batches: list[list[Any]] = []
        self.calls: list[tuple[str, Any]] = []
        self._assignment: list[TopicPartition] = []
        self.positions: dict[tuple[str, int], int] = {}
        self.leaving = False

    def subscribe(self, topics, on_assign, on_revoke, on_lost):
        self.on_assign, self.on_revoke = on_assign, on_revoke

    def consume(self, n, timeout):
        return self.batches.pop(0) if self.batches else []

    def poll(self, timeout):
        time.sleep(0.001)
        return None

    def position(self, partitions):
        return [TopicPartition(tp.topic, tp.partition, self.positions.get((tp.topic, tp.partition), -1001))
                for tp in partitions]

    def assignment(self):
        return list(self._assignment)

    def assign(self, partitions):
        self.calls.append(("assign", [tp.partition for tp in partitions]))
        self._assignment = list(partitions)

    def unassign(self):
        self.calls.append(("unassign", None))
        self._assignment = []

    def incremental_assign(self, partitions):
        self.calls.append(("incremental_assign", [tp.partition for tp in partitions]))
        self._assignment += partitions

    def incremental_unassign(self, partitions):
        self.calls.append(("incremental_unassign", [tp.partition for tp in partitions]))
        gone = {(tp.topic, tp.partition) for tp in partitions}
        self._assignment = [tp for tp in self._assignment if (tp.topic, tp.partition) not in gone]

    def pause(self, partitions):
        self.calls.append(("pause", sorted(tp.partition for tp in partitions)))

    def resume(self, partitions):
        self.calls.append(("resume", sorted(tp.partition for tp in partitions)))

    def seek(self, tp):
        pass

    def commit(self, offsets=None, asynchronous=True):
        self.calls.append(("commit", [(tp.partition, tp.offset) for tp in offsets]))
        return offsets

    def consumer_group_metadata(self):
        if self.leaving and not self._assignment:  # confluent-kafka's words, seen on a real close
            raise RuntimeError("Consumer group metadata not available")
        return "generation"

    def close(self):
        """As librdkafka's: leaving the group revokes what is assigned."""
        self.leaving = True
        if self._assignment:
            self.on_revoke(self, self.assignment())
        self.calls.append(("close", None))


class Committer:
    def __init__(self, tracker: OffsetTracker) -> None:
        self._tracker = tracker

    @property
    def in_flight(self) -> int:
        return self._tracker.in_flight

    def consumer_callbacks(self):
        return {}

    def turn(self, consumer, now):
        pass

    def commit(self, consumer, partitions=None):
        consumer.calls.append(("commit", partitions))


def make_source(metrics: Metrics | None = None, commits: Callable[[OffsetTracker], Any] = Committer, **overrides: Any):
    """``commits(tracker)``: the poll thread's commits (a fake that records them, by default)."""
    config = ServiceConfig(request_topics=["requests"], **overrides)
    tracker = OffsetTracker()
    models = FakeModels()
    intake = Intake(RequestDecoder("replies", 1000), tracker, models)
    source = Source(config, intake, tracker, commits(tracker), metrics or Metrics(), consumer_factory=FakeConsumer)
    return source, source._consumer, tracker, models.routed, models


def tp(partition: int) -> TopicPartition:
    return TopicPartition("requests", partition)


class Broken(FakeRecord):
    def headers(self):
        raise SystemError("returned a result with an exception set")

    def error(self):
        return None


class Record(FakeRecord):
    def error(self):
        return None


def test_every_record_of_a_batch_is_tracked_and_answered_whatever_one_of_them_does():
    source, consumer, tracker, routed, _ = make_source()
    source.rebalance.on_assign(consumer, [tp(0)])
    batch = [Record(b'"a"', offset=0), Broken(b'"b"', offset=1), Record(b'"c"', offset=2)]
    consumer.positions[("requests", 0)] = 3
    source._take_in(batch)
    assert [r.offset for r in routed] == [0, 1, 2]  # the broken record is handed on as a failed request
    assert routed[1].unroutable and routed[1].dead_letter
    assert [r.ok for r in routed] == [True, False, True]
    assert tracker.in_flight == 3  # all tracked: the commit cannot pass any of them unanswered


def test_a_fetch_goes_to_the_models_in_one_call_its_requests_with_their_ledgers():
    """Issue 27: each request woke its model's stages as it was routed; issue 38: the fetch is the unit, handed on
    in one call (each model's runner then admits and queues its share in one call)."""
    tracker = OffsetTracker()
    tracker.assign([("requests", 0)])
    models = FakeModels()
    intake = Intake(RequestDecoder("replies", 1000), tracker, models)
    intake.take([Record(b'"a"', offset=0), Record(b'"b"', offset=1), Record(b'"c"', offset=2)], print)
    assert len(models.routed) == 3 and models.takes == 1
    assert all(request.ledger is not None for request in models.routed)


def test_offsets_the_consumer_passed_without_handing_a_record_over_are_committed_across():
    """Issue 29: a transaction's commit marker (or aborted records, or compaction) leaves offsets no record is handed
    over for; the old tracker took them for a lost record and stopped the partition's commits there for good."""
    source, consumer, tracker, routed, _ = make_source()
    source.rebalance.on_assign(consumer, [tp(0), tp(1)])
    consumer.positions[("requests", 0)] = 6  # offsets 1..5: five aborted records and their marker
    source._take_in([Record(b'"a"', offset=0)])
    tracker.finish([routed[0]])
    assert [(p.partition, p.offset) for p in tracker.commit_offsets()] == [(0, 6)]
    consumer.positions[("requests", 1)] = 3  # a later fetch brought only markers: no record at all
    source._take_in([])
    assert [(p.partition, p.offset) for p in tracker.commit_offsets()] == [(0, 6), (1, 3)]


@pytest.mark.parametrize(("strategy", "assign", "unassign"), [
    ("cooperative-sticky", "incremental_assign", "incremental_unassign"),
    ("range", "assign", "unassign"),
])
def test_rebalances_use_the_protocol_s_own_calls_and_commit_what_moves(strategy, assign, unassign):
    source, consumer, _, _, _ = make_source(kafka_consumer={"partition.assignment.strategy": strategy})
    source.rebalance.on_assign(consumer, [tp(0), tp(1)])
    source.rebalance.on_revoke(consumer, [tp(1)])
    names = [name for name, _ in consumer.calls]
    assert names[0] == assign and unassign in names
    assert ("commit", [("requests", 1)]) in consumer.calls  # the revoked partition's answers, before it moves
    assert source.rebalance.partitions == {("requests", 0)} and source.rebalance.joined.is_set()


@pytest.mark.parametrize("strategy", ["cooperative-sticky", "range"])
@pytest.mark.parametrize(("taken", "line"), [("on_revoke", "revoked requests[1]"), ("on_lost", "lost requests[1]")])
def test_a_member_says_it_let_go_of_partitions_before_the_group_can_give_them_to_another(strategy, taken, line,
                                                                                         caplog):
    """Ownership is read from these lines (tests/faults): once unassigned, the next owner may be assigned before
    this thread runs again, so a line logged after the unassign could overlap the next owner's ``assigned``."""
    source, consumer, _, _, _ = make_source(kafka_consumer={"partition.assignment.strategy": strategy})
    source.rebalance.on_assign(consumer, [tp(0), tp(1)])
    logged_at_unassign = []

    def noting_the_log(unassign):
        def call(*args):
            logged_at_unassign.append(caplog.text)
            return unassign(*args)
        return call

    consumer.unassign = noting_the_log(consumer.unassign)
    consumer.incremental_unassign = noting_the_log(consumer.incremental_unassign)
    with caplog.at_level(logging.INFO, logger="kinference.consumer.path.rebalance"):
        getattr(source.rebalance, taken)(consumer, [tp(1)])
    assert len(logged_at_unassign) == 1 and line in logged_at_unassign[0]


def test_a_partition_assigned_back_after_a_pause_is_resumed():
    """librdkafka keeps a partition's pause across an unassign: assigned back, it must be resumed explicitly."""
    flow = FlowControl(max_in_flight=10, resume_in_flight=5, metrics=Metrics())
    consumer = FakeConsumer({})
    consumer.assign([tp(0)])
    flow.update(consumer, in_flight=10)  # paused
    consumer.unassign()
    flow.update(consumer, in_flight=0)  # resumes nothing: nothing is assigned
    consumer.calls.clear()
    flow.assigned(consumer, [tp(0)], owned=1)
    assert consumer.calls == [("resume", [0])]


@pytest.mark.parametrize(("strategy", "unassign"), [("cooperative-sticky", ("incremental_unassign", [0, 1])),
                                                   ("range", ("unassign", None))])
def test_leaving_the_group_ends_the_revoke_although_the_consumer_has_no_generation_left(strategy, unassign, caplog):
    """Once close() has unassigned, the consumer has no group metadata and says so with a RuntimeError (seen in CI on
    a clean stop): the revoke still ends, so the partitions stop counting as this member's, and the poll thread
    closes the consumer cleanly. Exactly-once reads the generation on a revoke (no publisher here: its transaction
    never comes, and it waits its 0.05 s)."""
    metrics = Metrics()
    source, consumer, *_ = make_source(metrics, kafka_consumer={"partition.assignment.strategy": strategy},
                                       commits=lambda tracker: TransactionCommits(tracker, Transactions(), 0.05))
    source._on_assign(consumer, [tp(0), tp(1)])
    source.start()
    with caplog.at_level(logging.INFO, logger="kinference.consumer"):
        source.close(time.monotonic() + 5)
    assert not source.alive and "consumer closed" in caplog.text
    assert source.rebalance.partitions == set()
    assert metrics.registry.get_sample_value("kinference_assigned_partitions") == 0
    assert consumer.calls[-2:] == [unassign, ("close", None)]


def test_a_fatal_consumer_error_ends_the_poll_loop():
    metrics = Metrics()
    source, consumer, _, _, _ = make_source(metrics)
    source.start()
    source.errors.on_client(KafkaError(KafkaError._FENCED, "fenced by a newer instance", fatal=True))
    deadline = time.monotonic() + 5
    while source._loop._thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not source.alive and source.errors.fatal.code() == KafkaError._FENCED
    assert metrics.registry.get_sample_value("kinference_fatal_errors_total", {"client": "consumer"}) == 1
    assert ("close", None) in consumer.calls and not any(name == "commit" for name, _ in consumer.calls)


def test_a_fatal_error_a_fetch_carries_ends_the_member_although_its_flag_is_unset():
    """Apache Kafka fences a static member through the fetch: code _FATAL, ``fatal()`` false (the member served on
    as a zombie before; tests/faults/test_exit.py shows it on the broker)."""
    source, *_ = make_source()
    source.errors.on_record(KafkaError(KafkaError._FATAL, "Static consumer fenced by other consumer"))
    assert source.errors.fatal is not None and not source.alive
