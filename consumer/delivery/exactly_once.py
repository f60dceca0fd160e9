"""Exactly-once (``--delivery exactly-once``): replies and the offsets they answer are committed in one transaction.

Everything in which this mode differs from at-least-once (``at_least_once``) is in this module; the publisher
(``publisher.Publisher``) produces the records and follows their reports as in every mode. What is particular here
is when an answer counts:

- Finished requests are held (they count towards ``--max-in-flight`` until committed) until every record
  before them in their partition is answered; the commit ledger (``commit``) computes that position (across the
  offsets no record was handed over for: transaction markers, aborted records, compaction). Held requests are keyed
  by their assignment (the partition's ledger), so that after a partition is revoked and handed back, a late copy
  of a request from the old assignment can never take the place of the new one: replies of detached ledgers are
  dropped (the partition's new owner serves them).
- Every ``commit_interval_s`` (and at once on a revoke or at close), one transaction holds exactly the answers
  of those runs plus ``send_offsets_to_transaction`` of the new positions, with the consumer's group metadata
  (read on the poll thread, ``turn``), so that a member that lost its partitions is fenced by the broker
  (KIP-447). Either the replies and the offsets are committed together, or neither is.
- A transaction, in order (``begin``, then the publisher produces its records, then ``end``):

  1. begin it;
  2. produce each request's answer (its plan: as the last transaction left it, when that one aborted);
  3. commit it, with the requests' offsets; committing flushes, so each of its records is reported first;
  4. committed: the requests are answered. Aborted (a record was refused, or the broker said so): the
     requests stay held, each with its plan as it stands now, for the next transaction.

- A record refused for good is replaced in its request's plan (``answers.replacement``). One that ``produce()``
  itself refused never entered the transaction: its replacement goes into the same one. Any other refusal fails
  the transaction, and the next one carries the record, or what replaced it.

librdkafka's transactional contract, followed to the letter:

- a retriable error from ``send_offsets_to_transaction``, ``commit_transaction`` or ``abort_transaction``
  repeats the same call;
- an error that ``txn_requires_abort()`` aborts the transaction; its requests stay held and are answered again
  in the next one. After ``ABORTS_BEFORE_UNHEALTHY`` aborts in a row the service stops;
- a fatal error (the producer was fenced by a newer instance with the same ``transactional.id``, or the broker
  refused it) stops the service with a non-zero exit: re-initialising would fence the other instance in turn, so
  the producer is never replaced (``replaces_producer``).

Clients must read replies with ``isolation.level=read_committed``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from kinference.consumer.delivery.commit import OffsetTracker, PartitionLedger
from kinference.consumer.ops.metrics import Metrics
from kinference.consumer.path.answers import Delivery, InFlight, Settled, answer
from kinference.consumer.path.request import Request
from kinference.consumer.types import PartitionKey

log = logging.getLogger(__name__)

ABORTS_BEFORE_UNHEALTHY = 5
"""Aborted transactions in a row after which the service stops (exit 1): something keeps failing them."""


class Abort(Exception):
    """The open transaction cannot commit: it is aborted, and its requests are answered in the next one."""

    def __init__(self, error: KafkaError) -> None:
        super().__init__(error.str())
        self.error = error


@dataclass(frozen=True, eq=False)
class Transaction:
    """These held requests, answered together with the offsets ``positions`` (each just past a run of them)."""

    requests: list[Request]
    positions: list[TopicPartition]


class ExactlyOnce:
    """Both threads' side of exactly-once. The publisher's, each turn: ``take`` the finished requests (held),
    ``begin`` (a transaction's records, when one is due), the reports (``delivered``, ``refused``), then ``end``
    (commit or abort). The poll thread's: ``turn`` and ``commit`` (a revoke, the close)."""

    replaces_producer = False
    """A transactional producer is never replaced: initialised again, it would fence the other instance of its id."""

    def __init__(self, tracker: OffsetTracker, dead_letter_topic: str, metrics: Metrics, commit_interval_s: float,
                 timeout_s: float = 30.0) -> None:
        self._tracker = tracker
        self._dead_letter_topic = dead_letter_topic
        self._metrics = metrics
        self._commit_interval_s = commit_interval_s
        self._timeout_s = timeout_s
        self._held: dict[PartitionLedger, dict[int, Request]] = {}
        """Finished requests not yet in a committed transaction, by assignment and offset."""
        self._plans: dict[Request, list[Delivery]] = {}
        """The records that answer each request of a transaction; kept, with what replaced refused records, for
        the next transaction when this one aborts."""
        self._open: Transaction | None = None
        self._doomed: KafkaError | None = None
        """Why the open transaction cannot commit: one of its records was refused."""
        self._landed: list[Delivery] = []
        """Records of the open transaction the broker acknowledged: they count once it commits."""
        self._generation: Any = None
        """The consumer's group generation, for ``send_offsets_to_transaction`` (zombie fencing)."""
        self._initialised = False
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
        """What flow control bounds: the ledger's, and the held requests (the ledger counts them finished, but they
        are not answered until their transaction commits)."""
        return self._tracker.in_flight + self.held

    # --- the publisher's side (the publisher thread)

    def take(self, requests: list[Request]) -> None:
        """Hold them all: they are answered in the transaction that commits their offsets."""
        held = []
        for request in requests:
            ledger: PartitionLedger | None = request.ledger
            if ledger is None or not ledger.attached:
                continue  # its partition moved on: the new owner answers it
            self._held.setdefault(ledger, {})[request.offset] = request
            held.append(request)
        self._tracker.finish(held)  # committable now; counted as held until their transaction commits

    def begin(self, producer: Any, now: float, final: bool) -> list[Delivery]:
        """A transaction when one is due (``final``: the last turn before stopping): begun, its records returned
        for the publisher to produce now. The first call registers the transactional id, fencing any earlier
        instance with the same id."""
        if not self._initialised:
            self._retrying(producer.init_transactions, self._timeout_s)
            self._initialised = True
            self._next_commit = now + self._commit_interval_s
        transaction = self._due(now, final)
        if transaction is None:
            return []
        producer.begin_transaction()
        self._open, self._doomed, self._landed = transaction, None, []
        # Plans of requests not in this transaction are stale: their partition moved to another member.
        plans, self._plans = self._plans, {}
        records = []
        for request in transaction.requests:
            # A plan may be empty: every record of it was given up on (unanswerable), and it commits as it is.
            plan = plans[request] if request in plans else answer(request, self._dead_letter_topic, now)
            self._plans[request] = plan
            records += plan
        return records

    def delivered(self, delivery: Delivery) -> None:
        self._landed.append(delivery)

    def refused(self, delivery: Delivery, error: KafkaError, replacements: list[Delivery] | None,
                at_once: bool) -> list[Delivery]:
        """A record of the open transaction was refused: for a passing reason (``replacements`` None), or for good,
        and ``replacements`` answer its request in its place (none: it is answered without it, unanswerable).
        ``at_once``: ``produce()`` itself refused it. Returns what to produce now."""
        if replacements is None or not at_once:
            self._doomed = self._doomed or error  # the next transaction carries the record, or what replaces it
        if replacements is None:
            return []
        plan = self._plans[delivery.request]
        place = next(i for i, planned in enumerate(plan) if planned is delivery)
        plan[place:place + 1] = replacements
        return replacements if at_once else []  # never in the transaction: the replacement goes into it

    def end(self, producer: Any, in_flight: InFlight) -> Settled:
        """Commit the open transaction, with its requests' offsets; or abort it, its requests held for the next."""
        transaction, self._open = self._open, None
        if transaction is None:
            return Settled([], [])
        try:
            if self._doomed is not None:
                raise Abort(self._doomed)
            self._commit(producer, transaction)
        except Abort as abort:
            in_flight.void()  # before the abort: what the aborted records still report is stale
            return Settled([], [], self._abort(producer, transaction, abort.error))
        self._plans = {}
        return Settled(transaction.requests, self._landed)

    def close(self) -> None:
        """The publisher leaves: nothing more becomes durable. A transactional call being retried gives up, and
        whoever waits in ``commit`` is woken."""
        with self._cycles:
            self._closed = True
            self._cycles.notify_all()

    # --- the poll thread's side: the consumer itself commits nothing

    def turn(self, consumer: Any, _now: float) -> None:
        """Each turn of the poll loop: read the group's generation for the next transaction (the publisher thread
        cannot ask the consumer: the call blocks while the poll thread is inside it)."""
        self._read_generation(consumer)

    def commit(self, consumer: Any, _partitions: list[PartitionKey] | None = None) -> None:
        """Revoke and close: a transaction with everything committable now, under the generation as it is now,
        waited for."""
        self._read_generation(consumer)
        if not self.commit_now(self._timeout_s):
            log.warning("no transaction committed within %.0f s", self._timeout_s)

    def commit_now(self, timeout_s: float) -> bool:
        """Ask for a transaction with everything committable now and wait for it."""
        with self._cycles:
            target = self._cycle_count + 2  # a cycle already running may have started before our requests
            self._commit_requested.set()
            return self._cycles.wait_for(lambda: self._cycle_count >= target or self._closed, timeout_s)

    # --- a transaction

    def _due(self, now: float, final: bool) -> Transaction | None:
        if not (final or self._commit_requested.is_set() or now >= self._next_commit):
            return None
        self._commit_requested.clear()
        self._next_commit = now + self._commit_interval_s
        self._drop_detached()
        positions = self._tracker.commit_offsets()
        if not positions:
            self._cycle_done()
            return None
        return Transaction(self._committable(positions), positions)

    def _commit(self, producer: Any, transaction: Transaction) -> None:
        """Send the offsets into the transaction and commit it (``Abort`` if the broker says so)."""
        self._retrying(producer.send_offsets_to_transaction, transaction.positions, self._generation,
                       self._timeout_s)
        self._retrying(producer.commit_transaction, self._timeout_s)
        for request in transaction.requests:
            self._held[request.ledger].pop(request.offset, None)
        self._tracker.committed(transaction.positions)
        self._metrics.commits.inc()
        self._aborts_in_a_row = 0
        self._cycle_done()

    def _abort(self, producer: Any, transaction: Transaction, error: KafkaError) -> str | None:
        """Abort it: its requests stay held for the next one. Returns why the service must stop, if it must."""
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
            ledger = ledgers.get((tp.topic, tp.partition))
            held = {} if ledger is None else self._held.get(ledger, {})
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

    def _read_generation(self, consumer: Any) -> None:
        """A consumer leaving the group (``close``) has no generation, and says so with a ``RuntimeError``: the last
        one read stays. Left to escape from a revoke, that error would end the callback half-way, and confluent-kafka
        turns it into a ``SystemError`` out of ``close()`` on Python 3.11 (seen in CI)."""
        try:
            self._generation = consumer.consumer_group_metadata()
        except RuntimeError as exc:
            log.debug("no group generation to read: %s", exc)
