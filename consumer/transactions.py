"""Exactly-once publishing: replies and the offsets they answer are committed in one transaction.

Used instead of ``publisher.Publisher`` with ``--delivery exactly-once``. Requests finish out of
order, so each partition's finished requests are held until they form a contiguous run from the last
committed offset (the commit tracker computes that position). One transaction then holds exactly
the replies (and dead letters) of those runs plus ``send_offsets_to_transaction`` of the new
positions, with the consumer's group metadata so that a member that lost its partitions in a
rebalance is fenced by the broker. Either the replies and the offsets are committed together, or
neither is: a crash before the commit leaves the transaction open (the broker aborts it) and the
requests are served again; a failed or fenced transaction is aborted and its requests are published
again in the next one. Clients must read replies with ``isolation.level=read_committed``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer, TopicPartition

from kinference.consumer.commit import OffsetTracker, PartitionKey
from kinference.consumer.metrics import Metrics
from kinference.consumer.publisher import dead_letter_record, observe, reply_record
from kinference.consumer.request import Request
from kinference.errors import RequestError
from kinference.protocol import ErrorCode

log = logging.getLogger(__name__)

_POLL_S = 0.05


class TransactionalPublisher:
    def __init__(
        self,
        producer_config: dict[str, str],
        transactional_id: str,
        dead_letter_topic: str,
        tracker: OffsetTracker,
        group_metadata: Callable[[], Any],
        queue_size: int,
        metrics: Metrics,
        commit_interval_s: float,
        timeout_s: float = 30.0,
        producer_factory: Callable[[dict[str, Any]], Any] = Producer,
    ) -> None:
        self._new_producer = partial(producer_factory, {**producer_config, "transactional.id": transactional_id})
        self._producer = self._new_producer()
        self._dead_letter_topic = dead_letter_topic
        self._tracker = tracker
        self._group_metadata = group_metadata
        self._inbox: queue.Queue[list[Request]] = queue.Queue(maxsize=queue_size)
        self._metrics = metrics
        self._commit_interval_s = commit_interval_s
        self._timeout_s = timeout_s
        self._held: dict[PartitionKey, dict[int, Request]] = {}
        """Finished requests not yet in a committed transaction, per partition, by offset."""
        self._refused: set[int] = set()
        """ids of requests whose reply the broker refused: the next attempt sends a dead letter only."""
        self._commit_requested = threading.Event()
        self._committed = threading.Condition()
        self._cycles = 0
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kinference-publisher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, requests: list[Request]) -> None:
        self._inbox.put(requests)

    def commit_now(self, timeout_s: float) -> bool:
        """Ask for a transaction with everything committable now and wait for it (partition revoke)."""
        with self._committed:
            target = self._cycles + 2  # a cycle already running may have started before our requests
            self._commit_requested.set()
            return self._committed.wait_for(lambda: self._cycles >= target or not self.alive, timeout_s)

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stopping.set()
        self._thread.join(timeout_s)
        self._producer = None  # see Publisher.stop: break the callback reference cycle now

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _init_transactions(self) -> None:
        """Register the transactional id (fencing any predecessor); waits for the broker to be reachable."""
        while not self._stopping.is_set():
            try:
                self._producer.init_transactions(self._timeout_s)
                return
            except KafkaException as exc:
                if not exc.args[0].retriable():
                    raise
                log.warning("init_transactions: %s; retrying", exc.args[0])

    def _run(self) -> None:
        self._init_transactions()
        next_commit = time.monotonic() + self._commit_interval_s
        while True:
            self._take_finished(timeout_s=max(0.0, min(_POLL_S, next_commit - time.monotonic())))
            stopping = self._stopping.is_set() and self._inbox.empty()
            if stopping or self._commit_requested.is_set() or time.monotonic() >= next_commit:
                self._commit_requested.clear()
                try:
                    self._cycle()
                except Exception:
                    log.exception("transaction cycle failed; its requests are published again next cycle")
                next_commit = time.monotonic() + self._commit_interval_s
                with self._committed:
                    self._cycles += 1
                    self._committed.notify_all()
            if stopping:
                return

    def _take_finished(self, timeout_s: float) -> None:
        try:
            requests = self._inbox.get(timeout=timeout_s)
        except queue.Empty:
            return
        now = time.monotonic()
        for request in requests:
            observe(self._metrics, request, now)
            self._held.setdefault((request.topic, request.partition), {})[request.offset] = request
            self._tracker.finish(request)  # "finished" here; committed only with the transaction

    def _cycle(self) -> None:
        self._forget_revoked()
        positions = self._tracker.commit_offsets()
        batch = [
            request
            for tp in positions
            for offset, request in sorted(self._held.get((tp.topic, tp.partition), {}).items())
            if offset < tp.offset
        ]
        if not positions:
            return
        try:
            self._commit_transaction(batch, positions)
        except KafkaException as exc:
            self._recover(exc.args[0], len(batch))
            return
        for request in batch:
            self._held[(request.topic, request.partition)].pop(request.offset, None)
            self._refused.discard(id(request))
        self._tracker.committed(positions)
        self._metrics.commits.inc()
        self._metrics.replies.labels("ok").inc(sum(1 for r in batch if r.ok))
        self._metrics.replies.labels("error").inc(sum(1 for r in batch if not r.ok))

    def _commit_transaction(self, batch: list[Request], positions: list[TopicPartition]) -> None:
        now = time.monotonic()
        self._producer.begin_transaction()
        for request in batch:
            if id(request) not in self._refused:
                self._produce(reply_record(request, now), request)
            if request.dead_letter or id(request) in self._refused:
                error = request.error if id(request) not in self._refused else RequestError(
                    f"reply to {request.reply_topic} could not be delivered", ErrorCode.INTERNAL_ERROR)
                self._produce(dead_letter_record(self._dead_letter_topic, request, error), request)
                self._metrics.dead_letters.inc()
        self._producer.send_offsets_to_transaction(positions, self._group_metadata(), self._timeout_s)
        self._producer.commit_transaction(self._timeout_s)

    def _produce(self, record: tuple, request: Request) -> None:
        topic, value, key, headers, partition = record
        kwargs = {} if partition is None else {"partition": partition}
        while True:
            try:
                self._producer.produce(topic, value, key, headers=headers,
                                       on_delivery=partial(self._delivered, request, topic), **kwargs)
                return
            except BufferError:
                self._producer.poll(_POLL_S)
            except KafkaException as exc:
                if exc.args[0].fatal():
                    raise
                self._delivered(request, topic, exc.args[0], None)  # refused at once: same as a failed delivery
                return

    def _delivered(self, request: Request, topic: str, err: KafkaError | None, _msg: Any) -> None:
        if err is not None and not err.fatal() and topic == request.reply_topic and topic != self._dead_letter_topic:
            # The record itself was refused (e.g. an unknown reply topic): retrying would fail forever.
            self._refused.add(id(request))
            self._metrics.delivery_failures.labels("reply").inc()

    def _recover(self, error: KafkaError, size: int) -> None:
        self._metrics.commit_failures.inc()
        if error.txn_requires_abort():
            log.warning("transaction of %d replies failed (%s); aborting, they are published again", size, error)
            self._producer.abort_transaction(self._timeout_s)
        elif error.retriable():
            log.warning("transaction commit not confirmed (%s); aborting and retrying", error)
            self._producer.abort_transaction(self._timeout_s)
        else:
            log.error("transactional producer failed (%s); replacing it", error)
            self._producer = self._new_producer()
            self._init_transactions()
            self._metrics.producer_replacements.inc()

    def _forget_revoked(self) -> None:
        """Held requests of partitions this member lost are the new owner's to serve."""
        for key, held in self._held.items():
            self._held[key] = {offset: r for offset, r in held.items() if r.ledger is not None and r.ledger.attached}
