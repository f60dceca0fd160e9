"""The commit rule of at-least-once delivery, kept in this one module.

Per partition, kinference commits offset N only when every record below N has been answered: its reply
(and dead letter, if any) was acknowledged by the broker. Records finish out of order (micro-batches,
several threads, error replies that skip the model); the ledger tracks them and moves the commit
position only over a contiguous run of finished offsets. A record whose partition was revoked is
never committed by this member: its ledger is detached, so late acknowledgements change nothing.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from confluent_kafka import TopicPartition

from kinference.consumer.request import Request

PartitionKey = tuple[str, int]


class PartitionLedger:
    """Offsets of one assigned partition that are consumed and not yet committable."""

    __slots__ = ("_done", "_pending", "abandoned", "attached", "key", "last_tracked", "position")

    def __init__(self, key: PartitionKey) -> None:
        self.key = key
        self._pending: deque[int] = deque()
        self._done: set[int] = set()
        self.abandoned = 0
        self.position: int | None = None
        """The next offset to commit: every offset below it is finished."""
        self.last_tracked = -1
        self.attached = True

    @property
    def in_flight(self) -> int:
        return len(self._pending) - len(self._done) - self.abandoned

    def track(self, offset: int) -> bool:
        if offset <= self.last_tracked:
            return False  # already consumed once in this assignment: a redelivery
        self.last_tracked = offset
        self._pending.append(offset)
        return True

    def finish(self, offset: int) -> None:
        self._done.add(offset)
        while self._pending and self._pending[0] in self._done:
            first = self._pending.popleft()
            self._done.discard(first)
            self.position = first + 1


class OffsetTracker:
    """All ledgers of this member's assignment; thread-safe.

    ``track`` runs on the poll thread, ``finish`` on the publisher thread (delivery callbacks),
    ``commit_offsets`` back on the poll thread, which alone talks to the consumer.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._ledgers: dict[PartitionKey, PartitionLedger] = {}
        self._committed: dict[PartitionKey, int] = {}

    def assign(self, partitions: list[PartitionKey]) -> None:
        with self._cond:
            for key in partitions:
                if key not in self._ledgers:
                    self._ledgers[key] = PartitionLedger(key)

    def revoke(self, partitions: list[PartitionKey]) -> None:
        """Detach these ledgers: replies still in flight for them will not move any commit."""
        with self._cond:
            for key in partitions:
                ledger = self._ledgers.pop(key, None)
                if ledger is not None:
                    ledger.attached = False
                self._committed.pop(key, None)
            self._cond.notify_all()

    def track(self, request: Request) -> bool:
        """Register a consumed record; it counts as in flight until ``finish`` or ``abandon``.

        False (and not registered) when its partition is not assigned to this member, or the record
        was tracked already: a record fetched before a revoke can still come out of the same
        ``consume()`` call that ran the revoke. Serving it would answer a request the next owner
        also serves, and commit a partition this member no longer owns; the caller drops it.
        """
        with self._cond:
            ledger = self._ledgers.get((request.topic, request.partition))
            if ledger is None or not ledger.track(request.offset):
                return False
            request.ledger = ledger
            return True

    def finish(self, request: Request) -> None:
        """The record is answered (reply acknowledged by the broker)."""
        with self._cond:
            ledger: PartitionLedger | None = request.ledger
            if ledger is not None and ledger.attached:
                ledger.finish(request.offset)
                self._cond.notify_all()

    def abandon(self, requests: list[Request]) -> None:
        """Records dropped unanswered (their partition is being revoked): the next owner serves
        them, so they leave the in-flight count but the commit position never passes them."""
        with self._cond:
            for request in requests:
                ledger: PartitionLedger | None = request.ledger
                if ledger is not None and ledger.attached:
                    ledger.abandoned += 1
            self._cond.notify_all()

    @property
    def in_flight(self) -> int:
        with self._cond:
            return sum(ledger.in_flight for ledger in self._ledgers.values())

    def wait_idle(self, timeout_s: float, partitions: list[PartitionKey] | None = None) -> bool:
        """Wait until no record of ``partitions`` (default: all) is in flight; False on timeout."""
        deadline = time.monotonic() + timeout_s

        def idle() -> bool:
            keys = self._ledgers.keys() if partitions is None else partitions
            return all(self._ledgers[k].in_flight <= 0 for k in keys if k in self._ledgers)

        with self._cond:
            while not idle():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def commit_offsets(self, partitions: list[PartitionKey] | None = None) -> list[TopicPartition]:
        """Offsets that moved since the last call (Kafka semantics: the next offset to consume)."""
        with self._cond:
            keys = list(self._ledgers) if partitions is None else partitions
            offsets = []
            for key in keys:
                ledger = self._ledgers.get(key)
                if ledger is None or ledger.position is None:
                    continue
                if self._committed.get(key) != ledger.position:
                    offsets.append(TopicPartition(key[0], key[1], ledger.position))
            return offsets

    def committed(self, offsets: list[TopicPartition]) -> None:
        """Record offsets the broker accepted, so they are not sent again."""
        with self._cond:
            for tp in offsets:
                if (tp.topic, tp.partition) in self._ledgers:
                    self._committed[(tp.topic, tp.partition)] = tp.offset
