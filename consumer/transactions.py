"""Exactly-once (``checkpoint.Checkpoint``): replies and the offsets they answer are committed in one transaction.

The checkpoint of ``--delivery exactly-once``; the publisher (``publisher.Publisher``) produces the answers and
follows the records as in every mode. What is particular here is when an answer counts:

- Finished requests are held (they count towards ``--max-in-flight`` until committed) until every record
  before them in their partition is answered; the commit tracker computes that position (across the offsets no
  record was handed over for: transaction markers, aborted records, compaction). Held requests are keyed by
  their assignment (the partition's ledger), so that after a partition is revoked and handed back, a late copy
  of a request from the old assignment can never take the place of the new one: replies of detached ledgers are
  dropped (the partition's new owner serves them).
- Every ``commit_interval_s`` (and at once on a revoke or at close), one transaction holds exactly the answers
  of those runs plus ``send_offsets_to_transaction`` of the new positions, with the consumer's group metadata,
  so that a member that lost its partitions is fenced by the broker (KIP-447). Either the replies and the
  offsets are committed together, or neither is.

librdkafka's transactional contract, followed to the letter:

- a retriable error from ``send_offsets_to_transaction``, ``commit_transaction`` or ``abort_transaction``
  repeats the same call;
- an error that ``txn_requires_abort()`` aborts the transaction; its requests stay held and are answered again
  in the next one (the publisher keeps what replaced a record refused for good). After
  ``ABORTS_BEFORE_UNHEALTHY`` aborts in a row the service stops;
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
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from kinference.consumer.checkpoint import Abort
from kinference.consumer.commit import OffsetTracker, PartitionLedger
from kinference.consumer.metrics import Metrics
from kinference.consumer.request import Request
from kinference.consumer.types import PartitionKey

log = logging.getLogger(__name__)

ABORTS_BEFORE_UNHEALTHY = 5
"""Aborted transactions in a row after which the service stops (exit 1): something keeps failing them."""


class TransactionCheckpoint:
    replaces_producer = False
    """A transactional producer is never replaced: initialised again, it would fence the other instance of its id."""

    def __init__(
        self,
        tracker: OffsetTracker,
        group_metadata: Callable[[], Any],
        metrics: Metrics,
        commit_interval_s: float,
        timeout_s: float = 30.0,
    ) -> None:
        """``group_metadata()``: the consumer's group generation, for ``send_offsets_to_transaction``."""
        self._tracker = tracker
        self._group_metadata = group_metadata
        self._metrics = metrics
        self._commit_interval_s = commit_interval_s
        self._timeout_s = timeout_s
        self._held: dict[PartitionLedger, dict[int, Request]] = {}
        """Finished requests not yet in a committed transaction, by assignment and offset."""
        self._next_commit = 0.0
        self._aborts_in_a_row = 0
        self._commit_requested = threading.Event()
        self._cycles = threading.Condition()
        self._cycle_count = 0
        self._closed = False

    @property
    def held(self) -> int:
        """Finished requests waiting for their transaction."""
        return sum(len(requests) for requests in list(self._held.values()))

    @property
    def in_flight(self) -> int:
        """The tracker's, and the held requests: the tracker counts them finished, but they are not answered until
        their transaction commits."""
        return self._tracker.in_flight + self.held

    # --- the publisher's side (the publisher thread)

    def open(self, producer: Any) -> None:
        """Register the transactional id, fencing any earlier instance with the same id."""
        self._retrying(producer.init_transactions, self._timeout_s)
        self._next_commit = time.monotonic() + self._commit_interval_s

    def close(self) -> None:
        with self._cycles:
            self._closed = True
            self._cycles.notify_all()

    def take(self, requests: list[Request]) -> list[Request]:
        """Hold them all: they are answered in the transaction that commits their offsets."""
        held = []
        for request in requests:
            ledger: PartitionLedger | None = request.ledger
            if ledger is None or not ledger.attached:
                continue  # its partition moved on: the new owner answers it
            self._held.setdefault(ledger, {})[request.offset] = request
            held.append(request)
        self._tracker.finish(held)  # committable now; counted as held until their transaction commits
        return []

    def acknowledged(self, requests: list[Request]) -> None:
        """Never called: every record is produced in a transaction."""

    def due(self, now: float, final: bool) -> _Transaction | None:
        if not (final or self._commit_requested.is_set() or now >= self._next_commit):
            return None
        self._commit_requested.clear()
        self._next_commit = now + self._commit_interval_s
        self._drop_detached()
        positions = self._tracker.commit_offsets()
        if not positions:
            self._cycle_done()
            return None
        return _Transaction(self, self._committable(positions), positions)

    # --- the source's side (the poll thread): the consumer itself commits nothing

    def maybe_commit(self, consumer: Any, now: float) -> None:
        """Transactions commit on their own interval, in the publisher thread."""

    def commit(self, consumer: Any, partitions: list[PartitionKey] | None = None) -> None:
        """Revoke and close: a transaction with everything committable now, waited for."""
        if not self.commit_now(self._timeout_s):
            log.warning("no transaction committed within %.0f s", self._timeout_s)

    def commit_now(self, timeout_s: float) -> bool:
        """Ask for a transaction with everything committable now and wait for it."""
        with self._cycles:
            target = self._cycle_count + 2  # a cycle already running may have started before our requests
            self._commit_requested.set()
            return self._cycles.wait_for(lambda: self._cycle_count >= target or self._closed, timeout_s)

    # --- a transaction's end (``_Transaction``)

    def finish(self, producer: Any, transaction: _Transaction) -> None:
        """Send the offsets into the transaction and commit it (``Abort`` if the broker says so)."""
        self._retrying(producer.send_offsets_to_transaction, transaction.positions, self._group_metadata(),
                       self._timeout_s)
        self._retrying(producer.commit_transaction, self._timeout_s)
        for request in transaction.requests:
            self._held[request.ledger].pop(request.offset, None)
        self._tracker.committed(transaction.positions)
        self._metrics.commits.inc()
        self._aborts_in_a_row = 0
        self._cycle_done()

    def abort(self, producer: Any, transaction: _Transaction, error: KafkaError) -> str | None:
        self._metrics.commit_failures.inc()
        self._aborts_in_a_row += 1
        log.warning("transaction of %d requests failed (%s); aborting, they are answered again in the next one",
                    len(transaction.requests), error)
        try:
            self._retrying(producer.abort_transaction, self._timeout_s)
        finally:
            self._cycle_done()
        if self._aborts_in_a_row >= ABORTS_BEFORE_UNHEALTHY:
            return f"{self._aborts_in_a_row} transactions in a row were aborted; last: {error.str()}"
        return None

    def _committable(self, positions: list[TopicPartition]) -> list[Request]:
        ledgers = {ledger.key: ledger for ledger in self._held if ledger.attached}
        batch = []
        for tp in positions:
            held = self._held.get(ledgers.get((tp.topic, tp.partition)), {})  # type: ignore[arg-type]
            batch += [request for offset, request in sorted(held.items()) if offset < tp.offset]
        return batch

    def _cycle_done(self) -> None:
        with self._cycles:
            self._cycle_count += 1
            self._cycles.notify_all()

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
                    raise Abort(error) from exc
                if not error.retriable() or self._closed:
                    raise
                log.warning("%s: %s; trying again", call.__name__, error)

    def _drop_detached(self) -> None:
        """Held requests of partitions this member lost are the new owner's to serve."""
        for ledger in [ledger for ledger in self._held if not ledger.attached]:
            del self._held[ledger]


@dataclass(eq=False)
class _Transaction:
    """One transaction of ``TransactionCheckpoint`` (``checkpoint.Transaction``): these held requests, answered
    together with the offsets ``positions`` (each just past a run of them)."""

    checkpoint: TransactionCheckpoint
    requests: list[Request]
    positions: list[TopicPartition]

    def begin(self, producer: Any) -> None:
        producer.begin_transaction()

    def commit(self, producer: Any) -> None:
        self.checkpoint.finish(producer, self)

    def abort(self, producer: Any, error: KafkaError) -> str | None:
        return self.checkpoint.abort(producer, self, error)


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
