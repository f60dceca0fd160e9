"""The commit rule, kept in this one module: an offset is committed only once its request is answered.

Per partition, kinference commits offset N only when every record below N that this member was handed has
been answered: its reply (and dead letter, if any) was acknowledged by the broker (at-least-once), or is
held for the next transaction (exactly-once, see ``exactly_once``). The ledger is shared by both delivery modes:
``at_least_once`` hands it the answered requests and commits the positions it computes on the poll thread,
``exactly_once`` commits them in its transactions. Records finish out of order
(micro-batches, several threads, error replies that skip the model); the ledger tracks them and moves the
commit position up to the first tracked record that is not answered.

Kafka offsets are not contiguous, and the rule is about records handed over, not about offsets: a transaction's
commit or abort marker, the records of an aborted transaction (skipped under ``read_committed``) and records
removed by compaction take offsets that no record is ever handed over for. The ledger commits across such gaps:
between two tracked records, by moving to the next tracked one; after the last one, by following the consumer's
position (``passed``), so that a partition whose log ends with a marker is committed to its end. It never commits
past a record it was handed and that is not answered.

Two more rules keep the position honest:

- Every record the consumer hands over is tracked before anything that can fail (``source``), so no
  record can fall through the poll loop and be committed over unanswered.
- A ledger belongs to one assignment. On revoke it is detached: late answers for it change nothing, and a
  partition assigned again gets a new ledger.

Share groups (``share``) acknowledge each record instead of committing offsets: gaps do not concern them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Container, Iterable, Sequence
from typing import Protocol

from confluent_kafka import TopicPartition

from kinference.consumer.ledger.request import Request
from kinference.consumer.types import PartitionKey

log = logging.getLogger(__name__)


class Ledger(Protocol):
    """Where a delivery mode hands the requests it answered: a consumer group's ``OffsetTracker`` (their offsets
    become committable) or a share group's ``share.ShareLedger`` (their records are acknowledged). The service waits
    on it at stop, never asking which it is."""

    def finish(self, requests: Iterable[Request], failed: Container[Request] = ()) -> None:
        """These requests are answered; ``failed``, those of them the delivery answered with an error of its own
        (``delivery.answers.Delivery.error``: their own ``error`` is None)."""

    @property
    def in_flight(self) -> int:
        """Records tracked and not answered."""

    def wait_idle(self, timeout_s: float, partitions: Iterable[PartitionKey] | None = None) -> bool:
        """Wait until no record is in flight (of ``partitions``, where the ledger has any); False on timeout."""


class PartitionLedger:
    """The offsets of one partition in one assignment that are consumed and not yet committable.

    Answers come a batch at a time, and mostly in order: finishing the run of offsets at the head of the ledger is
    one comparison and one step (``finish_run``), whatever its length; only offsets finished ahead of an unanswered
    one are held one by one (``_done``) until it is answered."""

    __slots__ = ("_done", "_head", "_pending", "abandoned", "attached", "key", "last_tracked", "passed", "position")

    _COMPACT = 4096
    """Offsets finished at the head before the list of tracked offsets drops them."""

    def __init__(self, key: PartitionKey) -> None:
        self.key = key
        self._pending: list[int] = []
        """Tracked offsets, ascending; those from ``_head`` on are not committable yet (finished ones above the first
        unanswered one wait in ``_done``)."""
        self._head = 0
        self._done: set[int] = set()
        self.abandoned = 0
        self.position: int | None = None
        """The next offset to commit: every record below it that was handed over is finished. None until one is."""
        self.last_tracked = -1
        self.passed = -1
        """The consumer's position: no record below it will be handed over in this assignment any more."""
        self.attached = True

    @property
    def in_flight(self) -> int:
        return len(self._pending) - self._head - len(self._done) - self.abandoned

    def track(self, offset: int) -> None:
        """Register ``offset``, above every offset tracked before (``OffsetTracker.track`` sees to it)."""
        self.last_tracked = offset
        self.passed = max(self.passed, offset + 1)
        self._pending.append(offset)

    def finish(self, offset: int) -> None:
        self.finish_run([offset])

    def finish_run(self, offsets: list[int]) -> None:
        """These offsets (ascending) are answered."""
        pending, head, done = self._pending, self._head, self._done
        if not done and pending[head:head + len(offsets)] == offsets:
            head += len(offsets)  # the run at the head, in one step: the common case
        else:
            done.update(offsets)
            if head == len(pending) or pending[head] not in done:
                return  # nothing new to commit: the first unanswered record is still the same
            while head < len(pending) and pending[head] in done:
                done.discard(pending[head])
                head += 1
        # Whatever lies between a finished record and the next tracked one was never handed over: a gap.
        self.position = pending[head] if head < len(pending) else self.passed
        if head >= self._COMPACT and 2 * head >= len(pending):
            del pending[:head]
            head = 0
        self._head = head

    def pass_to(self, position: int) -> None:
        """The consumer's next record will be at ``position`` or above: the offsets up to it that were never
        handed over are gaps, committed across once every record before them is answered."""
        if position <= self.passed:
            return
        self.passed = position
        if self._head == len(self._pending):
            self.position = position


class OffsetTracker:
    """All ledgers of this member's assignment; thread-safe.

    ``track`` runs on the poll thread, ``finish`` on the publisher thread (delivery callbacks),
    ``commit_offsets`` back on the poll thread, which alone talks to the consumer.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._ledgers: dict[PartitionKey, PartitionLedger] = {}
        self._committed: dict[PartitionKey, int] = {}

    def assign(self, partitions: Iterable[PartitionKey]) -> None:
        with self._cond:
            for key in partitions:
                if key not in self._ledgers:
                    self._ledgers[key] = PartitionLedger(key)

    def revoke(self, partitions: Iterable[PartitionKey]) -> None:
        """Detach these ledgers: answers still in flight for them will not move any commit."""
        with self._cond:
            for key in partitions:
                ledger = self._ledgers.pop(key, None)
                if ledger is not None:
                    ledger.attached = False
                self._committed.pop(key, None)
            self._cond.notify_all()

    def partitions(self) -> list[PartitionKey]:
        """The partitions of this member's assignment."""
        with self._cond:
            return list(self._ledgers)

    def track(self, key: PartitionKey, offset: int) -> PartitionLedger | None:
        """Register one consumed record (``track_fetch`` of one)."""
        return self.track_fetch([(key, offset)])[0]

    def track_fetch(self, records: Sequence[tuple[PartitionKey, int]]) -> list[PartitionLedger | None]:
        """Register one fetch's consumed records, in the order consumed, under one lock; each one's ledger. A record
        counts as in flight until ``finish`` or ``abandon``.

        None (and not registered) for a record whose partition is not assigned to this member: a record fetched
        before a revoke can still come out of the same ``consume()`` call that ran the revoke. Serving it would
        answer a request the next owner also serves, and commit a partition this member no longer owns; the caller
        drops it.

        A record at or below the last one tracked means the consumer went back (kinference never seeks back: a
        truncated log, or ``auto.offset.reset`` after an out-of-range offset). Dropping it, as a redelivery, would
        skip the records that are there now, and never commit them; instead the partition gets a new ledger that
        starts at it (the old one is detached, as on a revoke: its late answers move no commit), and it is logged.
        """
        ledgers: list[PartitionLedger | None] = []
        rewinds = []
        with self._cond:
            for key, offset in records:
                ledger = self._ledgers.get(key)
                if ledger is not None and offset <= ledger.last_tracked:
                    rewinds.append((ledger, offset))
                    ledger = self._restart(key)
                if ledger is not None:
                    ledger.track(offset)
                ledgers.append(ledger)
        for old, offset in rewinds:
            log.warning("%s[%d]: the consumer went back from offset %d to %d (a truncated log, or auto.offset.reset "
                        "after an out-of-range offset); the partition's ledger restarts there, and %d requests in "
                        "flight before it no longer move its commit position", old.key[0], old.key[1],
                        old.last_tracked, offset, old.in_flight)
        return ledgers

    def _restart(self, key: PartitionKey) -> PartitionLedger:
        """A new ledger for ``key``, the old one detached (the lock held)."""
        self._ledgers[key].attached = False
        ledger = self._ledgers[key] = PartitionLedger(key)
        self._committed.pop(key, None)
        return ledger

    def passed(self, positions: Iterable[tuple[PartitionKey, int]]) -> None:
        """The consumer's positions (the next offset it will hand over, per partition), read after every record
        it handed over was tracked: the offsets below them that were never tracked are gaps (see the module)."""
        with self._cond:
            for key, position in positions:
                ledger = self._ledgers.get(key)
                if ledger is not None:
                    ledger.pass_to(position)

    def finish(self, requests: Iterable[Request], failed: Container[Request] = ()) -> None:
        """These records are answered (replies acknowledged by the broker, or held for the transaction), whatever
        with (``failed``: not this ledger's concern). Many at once: one lock for all the acknowledgements one poll
        of the producer brought."""
        runs = _runs(requests)
        with self._cond:
            for ledger, offsets in runs:
                if ledger.attached:
                    ledger.finish_run(offsets)
            self._cond.notify_all()

    def abandon(self, requests: Iterable[Request]) -> None:
        """Records dropped unanswered (their partition is being revoked): the next owner serves them, so they
        leave the in-flight count but the commit position never passes them."""
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

    def wait_idle(self, timeout_s: float, partitions: Iterable[PartitionKey] | None = None) -> bool:
        """Wait until no record of ``partitions`` (default: all) is in flight; False on timeout."""
        deadline = time.monotonic() + timeout_s
        keys = None if partitions is None else list(partitions)

        def idle() -> bool:
            # An empty list (a cooperative revoke of nothing) waits for nothing, not for every partition.
            return all(self._ledgers[k].in_flight <= 0 for k in (self._ledgers if keys is None else keys)
                       if k in self._ledgers)

        with self._cond:
            while not idle():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def commit_offsets(self, partitions: Iterable[PartitionKey] | None = None) -> list[TopicPartition]:
        """Offsets that moved since the last commit (Kafka semantics: the next offset to consume)."""
        with self._cond:
            keys = list(self._ledgers) if partitions is None else partitions
            offsets = []
            for key in keys:
                ledger = self._ledgers.get(key)
                position = None if ledger is None else ledger.position
                if position is not None and self._committed.get(key) != position:
                    offsets.append(TopicPartition(key[0], key[1], position))
            return offsets

    def committed(self, offsets: Iterable[TopicPartition]) -> None:
        """Record offsets the broker accepted, so they are not sent again."""
        with self._cond:
            for tp in offsets:
                if (tp.topic, tp.partition) in self._ledgers:
                    self._committed[(tp.topic, tp.partition)] = tp.offset


def _runs(requests: Iterable[Request]) -> list[tuple[PartitionLedger, list[int]]]:
    """The offsets of ``requests``, ascending, per ledger (none for a request without one): one ledger in the common
    case, a micro-batch's requests being of one partition."""
    requests = list(requests)
    if not requests:
        return []
    ledger: PartitionLedger | None = requests[0].ledger
    if ledger is not None and all(request.ledger is ledger for request in requests):
        return [(ledger, sorted([request.offset for request in requests]))]
    by_ledger: dict[PartitionLedger, list[int]] = {}
    for request in requests:
        if request.ledger is not None:
            by_ledger.setdefault(request.ledger, []).append(request.offset)
    return [(ledger, sorted(offsets)) for ledger, offsets in by_ledger.items()]
