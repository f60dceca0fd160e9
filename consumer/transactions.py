"""Exactly-once publishing: replies and the offsets they answer are committed in one transaction.

Used instead of ``publisher.Publisher`` with ``--delivery exactly-once``; what answers a request, how a refused
record is replaced and the thread are the same (``Publisher``). What differs is when an answer counts:

- Finished requests are held (they count towards ``--max-in-flight`` until committed) until they form a
  contiguous run from the last committed offset of their partition; the commit tracker computes that
  position. Held requests are keyed by their assignment (the partition's ledger), so that after a partition is
  revoked and handed back, a late copy of a request from the old assignment can never take the place of the
  new one: replies of detached ledgers are dropped (the partition's new owner serves them).
- One transaction then holds exactly the answers of those runs plus ``send_offsets_to_transaction`` of the
  new positions, with the consumer's group metadata, so that a member that lost its partitions is fenced by
  the broker (KIP-447). Either the replies and the offsets are committed together, or neither is.

librdkafka's transactional contract, followed to the letter:

- a retriable error from ``send_offsets_to_transaction``, ``commit_transaction`` or ``abort_transaction``
  repeats the same call;
- an error that ``txn_requires_abort()`` aborts the transaction; its requests stay held and are answered again
  in the next one. A record refused for good during the aborted transaction has its replacement answer
  (``answers.replacement``) in the next one; a record that only timed out or was purged is produced again as
  it was. After ``ABORTS_BEFORE_UNHEALTHY`` aborts in a row the service reports unhealthy;
- a fatal error (the producer was fenced by a newer instance with the same ``transactional.id``, or the broker
  refused it) stops the service with a non-zero exit: re-initialising would fence the other instance in turn.

Clients must read replies with ``isolation.level=read_committed``.
"""

from __future__ import annotations

import fcntl
import logging
import re
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from confluent_kafka import KafkaError, KafkaException, Producer, TopicPartition

from kinference.consumer.answers import Delivery, answer, replacement
from kinference.consumer.commit import OffsetTracker, PartitionKey, PartitionLedger
from kinference.consumer.metrics import Metrics
from kinference.consumer.publisher import Publisher
from kinference.consumer.request import Request

if TYPE_CHECKING:
    from kinference.consumer.tracing import Tracing

log = logging.getLogger(__name__)

ABORTS_BEFORE_UNHEALTHY = 5
"""Aborted transactions in a row after which the service stops (exit 1): something keeps failing them."""


class _Abort(Exception):
    def __init__(self, error: KafkaError) -> None:
        super().__init__(error.str())
        self.error = error


class TransactionalPublisher(Publisher):
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
        tracing: Tracing | None = None,
    ) -> None:
        # A request is answered when its transaction commits (``_committed``), not at each acknowledgement.
        super().__init__({**producer_config, "transactional.id": transactional_id}, dead_letter_topic,
                         on_answered=lambda requests: None, queue_size=queue_size, metrics=metrics,
                         producer_factory=producer_factory, tracing=tracing)
        self._tracker = tracker
        self._group_metadata = group_metadata
        self._commit_interval_s = commit_interval_s
        self._timeout_s = timeout_s
        self._held: dict[PartitionLedger, dict[int, Request]] = {}
        """Finished requests not yet in a committed transaction, by assignment and offset."""
        self._plans: dict[Request, list[Delivery]] = {}
        """Answers that replace records refused for good in an aborted transaction."""
        self._sent: list[Delivery] = []
        """The records of the open transaction."""
        self._transaction = 0
        self._doomed: KafkaError | None = None
        """Why the open transaction cannot commit: one of its records was refused (even at once, at produce)."""
        self._next_commit = 0.0
        self._aborts_in_a_row = 0
        self._final_cycle_done = False
        self._commit_requested = threading.Event()
        self._cycles = threading.Condition()
        self._cycle_count = 0

    def commit_now(self, timeout_s: float) -> bool:
        """Ask for a transaction with everything committable now and wait for it (partition revoke, close)."""
        with self._cycles:
            target = self._cycle_count + 2  # a cycle already running may have started before our requests
            self._commit_requested.set()
            return self._cycles.wait_for(lambda: self._cycle_count >= target or not self.alive, timeout_s)

    @property
    def held(self) -> int:
        return sum(len(requests) for requests in list(self._held.values()))

    # --- as the source's committer: the consumer itself commits nothing, offsets go into transactions

    def maybe_commit(self, consumer: Any, now: float) -> None:
        """Transactions commit on their own interval, in the publisher thread."""

    def commit(self, consumer: Any, partitions: list[PartitionKey] | None = None) -> None:
        """Revoke and close: a transaction with everything committable now, waited for."""
        if not self.commit_now(self._timeout_s):
            log.warning("no transaction committed within %.0f s", self._timeout_s)

    # --- the publisher thread

    def _open(self) -> None:
        """Register the transactional id, fencing any earlier instance with the same id."""
        self._retrying(self._producer.init_transactions, self._timeout_s)
        self._next_commit = time.monotonic() + self._commit_interval_s

    def _done(self) -> bool:
        return self.failure is not None or self._abandon.is_set() or self._final_cycle_done

    def _accept(self, requests: list[Request], now: float) -> None:
        held = []
        for request in requests:
            ledger: PartitionLedger | None = request.ledger
            if ledger is None or not ledger.attached:
                continue  # its partition moved on: the new owner answers it
            self._held.setdefault(ledger, {})[request.offset] = request
            held.append(request)
        self._tracker.finish(held)  # committable now; counted as held until their transaction commits

    def _tick(self, now: float) -> None:
        final = self._stopping.is_set() and self._inbox.empty()
        if not (final or self._commit_requested.is_set() or now >= self._next_commit):
            return
        self._commit_requested.clear()
        self._cycle()
        self._next_commit = time.monotonic() + self._commit_interval_s
        self._final_cycle_done = final
        with self._cycles:
            self._cycle_count += 1
            self._cycles.notify_all()

    def _cycle(self) -> None:
        self._drop_detached()
        positions = self._tracker.commit_offsets()
        if not positions:
            return
        batch = self._committable(positions)
        self._sent, self._doomed = [], None
        self._transaction += 1
        self._producer.begin_transaction()
        now = time.monotonic()
        for request in batch:
            for delivery in self._plans.get(request) or answer(request, self._dead_letter_topic, now):
                delivery.transaction = self._transaction
                self._sent.append(delivery)
                self._send(delivery)
        try:
            if self._doomed is not None:
                raise _Abort(self._doomed)
            self._retrying(self._producer.send_offsets_to_transaction, positions, self._group_metadata(),
                           self._timeout_s)
            self._retrying(self._producer.commit_transaction, self._timeout_s)
        except _Abort as abort:
            self._abort(abort.error, len(batch))
            return
        self._committed(batch, positions)

    def _committable(self, positions: list[TopicPartition]) -> list[Request]:
        ledgers = {ledger.key: ledger for ledger in self._held if ledger.attached}
        batch = []
        for tp in positions:
            held = self._held.get(ledgers.get((tp.topic, tp.partition)), {})  # type: ignore[arg-type]
            batch += [request for offset, request in sorted(held.items()) if offset < tp.offset]
        return batch

    def _committed(self, batch: list[Request], positions: list[TopicPartition]) -> None:
        for request in batch:
            self._held[request.ledger].pop(request.offset, None)
            self._plans.pop(request, None)
        for delivery in self._sent:
            if delivery.kind == "reply":
                self._metrics.labelled(self._metrics.replies, "ok" if delivery.request.ok else "error").inc()
            else:
                self._metrics.dead_letters.inc()
        self._sent = []
        self._trace_answered(batch)
        self._tracker.committed(positions)
        self._metrics.commits.inc()
        self._aborts_in_a_row = 0

    def _abort(self, error: KafkaError, size: int) -> None:
        self._metrics.commit_failures.inc()
        self._aborts_in_a_row += 1
        log.warning("transaction of %d requests failed (%s); aborting, they are answered again in the next one",
                    size, error)
        self._retrying(self._producer.abort_transaction, self._timeout_s)
        self._sent = []
        self._transaction += 1  # the purge reports of the aborted records are stale now
        if self._aborts_in_a_row >= ABORTS_BEFORE_UNHEALTHY:
            self._fail(f"{self._aborts_in_a_row} transactions in a row were aborted; last: {error.str()}")

    def _retrying(self, call: Callable[..., Any], *args: Any) -> None:
        """One call of the transactional API, repeated while it fails with a retriable error."""
        while True:
            try:
                call(*args)
                return
            except KafkaException as exc:
                error: KafkaError = exc.args[0]
                if error.fatal():
                    raise
                if error.txn_requires_abort():
                    raise _Abort(error) from exc
                if not error.retriable() or self._abandon.is_set():
                    raise
                log.warning("%s: %s; trying again", call.__name__, error)

    def _drop_detached(self) -> None:
        """Held requests of partitions this member lost are the new owner's to serve."""
        for ledger in [ledger for ledger in self._held if not ledger.attached]:
            for request in self._held.pop(ledger).values():
                self._plans.pop(request, None)

    # --- delivery outcomes inside a transaction: the transaction decides

    def _on_delivery(self, delivery: Delivery, error: KafkaError | None, message: Any) -> None:
        if delivery.transaction == self._transaction:  # else: purged by an abort already handled
            super()._on_delivery(delivery, error, message)

    def _delivered(self, delivery: Delivery) -> None:
        """Acknowledged, but only visible if the transaction commits: counted then."""

    def _refused_for_now(self, delivery: Delivery, error: KafkaError) -> None:
        """Timed out or purged: the transaction aborts, and the same record goes into the next one."""
        self._doomed = self._doomed or error

    def _replace(self, delivery: Delivery, error: KafkaError) -> None:
        """Refused for good: the transaction aborts, and the next one carries the replacement."""
        self._doomed = self._doomed or error
        request = delivery.request
        deliveries = replacement(delivery, error, self._dead_letter_topic, time.monotonic())
        if not deliveries:
            self._unanswerable(request, f"{delivery.record[0]} refused the dead letter: {error}")
            return
        current = self._plans.get(request) or [d for d in self._sent if d.request is request]
        self._plans[request] = [d for d in current if d is not delivery] + deliveries

    def _check_producer(self) -> None:
        if self._fatal is not None:
            raise KafkaException(self._fatal)


class MemberSlot:
    """A stable identity for this member on this host: the lowest slot number no live process of the same
    group holds, kept by an exclusive lock on a file until the process exits (or ``close``).

    A restarted member gets its slot back (the kernel released its predecessor's lock), so
    ``transactional_id`` names the same producer across restarts: the new instance fences its own zombie at
    ``init_transactions`` and aborts its open transaction at once, instead of read_committed readers waiting
    out ``transaction.timeout.ms``. Several members on one host get different slots.
    """

    def __init__(self, group_id: str, directory: Path | None = None) -> None:
        self._directory = Path(directory or tempfile.gettempdir())
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", group_id)
        self._file: IO[bytes] | None = None
        self.slot = 0
        while True:
            handle = open(self._directory / f"kinference-{safe}.slot{self.slot}.lock", "ab")  # noqa: SIM115
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                handle.close()
                self.slot += 1
                continue
            self._file = handle
            return

    def transactional_id(self, group_id: str) -> str:
        return f"kinference-{group_id}-{socket.gethostname()}-{self.slot}"

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
