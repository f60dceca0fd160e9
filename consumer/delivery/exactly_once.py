"""Exactly-once (``--delivery exactly-once``): replies and the offsets they answer are committed in one transaction.

The mode has the same two sides as at-least-once (``at_least_once``), each entered from one thread: on the publisher
thread ``ExactlyOnce`` (this module), on the poll thread ``ledger.commits.TransactionCommits``, on the floor below,
where the source reaches it; what they tell each other goes through ``ledger.commits.Transactions``. The publisher
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
  (read on the poll thread, ``TransactionCommits.turn``), so that a member that lost its partitions is fenced by the
  broker (KIP-447). Either the replies and the offsets are committed together, or neither is.
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

- A generative request's stream chunks are not produced (``streams``): only its final, in the transaction that
  commits its offset.

Clients must read replies with ``isolation.level=read_committed``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from kinference.consumer.delivery.answers import Delivery, InFlight, Record, Settled, StreamChunk, answer_all
from kinference.consumer.ledger.commit import OffsetTracker, PartitionLedger
from kinference.consumer.ledger.commits import Transactions
from kinference.consumer.ledger.request import Request
from kinference.consumer.ops.metrics import Metrics
from kinference.errors import RequestError

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
    """The publisher's side of exactly-once, entered from the publisher thread (and ``close`` from the thread that
    stops the publisher too). Each turn of the publisher: ``take`` the finished requests (held), ``begin`` (a
    transaction's records, when one is due), the reports (``delivered``, ``refused``), then ``end`` (commit or
    abort)."""

    replaces_producer = False
    """A transactional producer is never replaced: initialised again, it would fence the other instance of its id."""

    streams = False
    """No stream chunks, only each generative request's final: a transactional producer writes only inside a
    transaction, and a read_committed client would see a chunk only once that transaction commits, with the final
    (so a generative model makes none: ``path.generations.GenerationSettings.chunks``)."""

    def __init__(self, tracker: OffsetTracker, transactions: Transactions, dead_letter_topic: str, metrics: Metrics,
                 commit_interval_s: float, timeout_s: float = 30.0) -> None:
        """``transactions``: what the poll thread's side (``TransactionCommits``) tells this one, and is told."""
        self._tracker = tracker
        self._transactions = transactions
        self._dead_letter_topic = dead_letter_topic
        self._metrics = metrics
        self._commit_interval_s = commit_interval_s
        self._timeout_s = timeout_s
        self._held: dict[PartitionLedger, dict[int, Request]] = {}
        """Finished requests not yet in a committed transaction, by assignment and offset."""
        self._plans: dict[Request, list[Delivery]] = {}
        """The records that answer each request of a transaction; kept, with what replaced refused records, for
        the next transaction when this one aborts."""
        self._misdirected: dict[Request, RequestError] = {}
        """Held requests whose reply partition does not exist (``answers.ReplyPartitions``), with their error."""
        self._open: Transaction | None = None
        self._doomed: KafkaError | None = None
        """Why the open transaction cannot commit: one of its records was refused."""
        self._landed: list[Delivery] = []
        self._errors: dict[Request, RequestError] = {}
        """The delivery's own errors (``Delivery.error``) of held requests, the first of each: kept across an abort,
        since a plan's record given up on (unanswerable) is not produced again; handed on when their transaction
        commits."""
        """Records of the open transaction the broker acknowledged: they count once it commits."""
        self._initialised = False
        self._next_commit = 0.0
        self._aborts_in_a_row = 0

    @property
    def held(self) -> int:
        """Finished requests waiting for their transaction."""
        return sum(len(requests) for requests in self._held.values())

    def take(self, requests: list[Request], misdirected: dict[Request, RequestError] | None = None) -> None:
        """Hold them all: they are answered in the transaction that commits their offsets (``misdirected``: those
        whose reply partition does not exist, with their error)."""
        held = []
        for request in requests:
            ledger: PartitionLedger | None = request.ledger
            if ledger is None or not ledger.attached:
                continue  # its partition moved on: the new owner answers it
            self._held.setdefault(ledger, {})[request.offset] = request
            held.append(request)
            if misdirected and request in misdirected:
                self._misdirected[request] = misdirected[request]
        self._transactions.held = self.held  # before the ledger counts them finished: flow control sees them always
        self._tracker.finish(held)  # committable now; counted as held until their transaction commits

    def stream(self, _chunks: Sequence[StreamChunk]) -> list[Record]:
        """None of them is produced (``streams``)."""
        return []

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
        fresh = [request for request in transaction.requests if request not in plans]
        for delivery in answer_all(fresh, self._dead_letter_topic, now, self._misdirected):
            plans.setdefault(delivery.request, []).append(delivery)
        records = []
        for request in transaction.requests:
            # A plan may be empty: every record of it was given up on (unanswerable), and it commits as it is.
            plan = self._plans[request] = plans.get(request, [])
            records += plan
        return records

    def delivered(self, delivery: Delivery) -> None:
        self._landed.append(delivery)
        if delivery.error is not None:
            self._errors.setdefault(delivery.request, delivery.error)

    def refused(self, delivery: Delivery, error: KafkaError, replacements: list[Delivery] | None,
                at_once: bool) -> list[Delivery]:
        """A record of the open transaction was refused: for a passing reason (``replacements`` None), or for good,
        and ``replacements`` answer its request in its place (none: it is answered without it, unanswerable).
        ``at_once``: ``produce()`` itself refused it. Returns what to produce now."""
        if delivery.error is not None:
            self._errors.setdefault(delivery.request, delivery.error)
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
        errors = {}
        if self._errors:
            errors = {request: error for request in transaction.requests
                      if (error := self._errors.pop(request, None)) is not None}
        return Settled(transaction.requests, self._landed, errors=errors)

    def close(self) -> None:
        """The publisher leaves: nothing more becomes durable. A transactional call being retried gives up, and
        whoever waits for a transaction (``TransactionCommits.commit``) is woken."""
        self._transactions.close()

    # --- a transaction

    def _due(self, now: float, final: bool) -> Transaction | None:
        if not (final or self._transactions.asked.is_set() or now >= self._next_commit):
            return None
        self._transactions.asked.clear()
        self._next_commit = now + self._commit_interval_s
        self._drop_detached()
        positions = self._tracker.commit_offsets()
        if not positions:
            self._transactions.cycle_done()
            return None
        return Transaction(self._committable(positions), positions)

    def _commit(self, producer: Any, transaction: Transaction) -> None:
        """Send the offsets into the transaction and commit it (``Abort`` if the broker says so)."""
        self._retrying(producer.send_offsets_to_transaction, transaction.positions, self._transactions.generation,
                       self._timeout_s)
        self._retrying(producer.commit_transaction, self._timeout_s)
        for request in transaction.requests:
            self._held[request.ledger].pop(request.offset, None)
        if self._misdirected:
            for request in transaction.requests:
                self._misdirected.pop(request, None)
        self._transactions.held = self.held
        self._tracker.committed(transaction.positions)
        self._metrics.commits.inc()
        self._aborts_in_a_row = 0
        self._transactions.cycle_done()

    def _abort(self, producer: Any, transaction: Transaction, error: KafkaError) -> str | None:
        """Abort it: its requests stay held for the next one. Returns why the service must stop, if it must."""
        self._metrics.commit_failures.inc()
        self._aborts_in_a_row += 1
        log.warning("transaction of %d requests failed (%s); aborting, they are answered again in the next one",
                    len(transaction.requests), error)
        try:
            self._retrying(producer.abort_transaction, self._timeout_s)
        finally:
            self._transactions.cycle_done()
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
                if not error.retriable() or self._transactions.closed:
                    raise
                log.warning("%s: %s; trying again", call.__name__, error)

    def _drop_detached(self) -> None:
        """Held requests of partitions this member lost are the new owner's to serve."""
        for ledger in [ledger for ledger in self._held if not ledger.attached]:
            del self._held[ledger]
        self._misdirected = {request: error for request, error in self._misdirected.items() if request.ledger.attached}
        self._transactions.held = self.held
