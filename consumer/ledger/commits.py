"""The poll thread's side of both delivery modes: what the source and its rebalances call to make answered requests
durable. The publisher's side of each mode (``delivery.at_least_once.AtLeastOnce``,
``delivery.exactly_once.ExactlyOnce``) hands answered requests over; this side, on the poll thread, which alone calls
the consumer, commits them:

- at-least-once, ``OffsetCommits``: an asynchronous commit of the positions the ledger (``commit``) moved, every
  ``commit_interval_ms``; a synchronous one on revoke and at close. The ledger is what the two threads share;
- exactly-once, ``TransactionCommits``: the consumer itself commits nothing, the offsets go into the publisher's
  transactions. Each turn it reads the group's generation for them (the publisher thread cannot ask the consumer:
  the call blocks while the poll thread is inside it); on revoke and at close it asks for a transaction and waits
  for it. What the two threads share, beside the ledger, is ``Transactions``.

The source sees either through one interface (``Commits``) and never asks which it has. A share group has neither:
its source acknowledges each record (``share``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from kinference.consumer.ledger.commit import OffsetTracker
from kinference.consumer.ops.metrics import Metrics
from kinference.consumer.types import PartitionKey

log = logging.getLogger(__name__)


class Commits(Protocol):
    """A delivery mode's poll-thread side, as the source and its rebalances see it (poll thread only)."""

    @property
    def in_flight(self) -> int:
        """What flow control bounds: the requests taken in and not yet durable."""

    def consumer_callbacks(self) -> dict[str, Callable[..., None]]:
        """The librdkafka callbacks this side needs in the consumer's configuration."""

    def turn(self, consumer: Any, now: float) -> None:
        """Each turn of the poll loop, after the poll's records are taken in."""

    def commit(self, consumer: Any, partitions: list[PartitionKey] | None = None) -> None:
        """Revoke and close: make what is answered of ``partitions`` (default: all) durable now, and wait."""


class OffsetCommits:
    """The poll thread's side of at-least-once: it commits the positions the ledger moved."""

    def __init__(self, tracker: OffsetTracker, metrics: Metrics, interval_s: float) -> None:
        self._tracker = tracker
        self._metrics = metrics
        self._interval_s = interval_s
        self._next = 0.0
        self._waiting = False
        """An asynchronous commit is out: the next waits for its report, so that commits never pile up while the
        coordinator does not answer (a rebalance, a fail-over)."""

    @property
    def in_flight(self) -> int:
        """What flow control bounds: nothing waits here (a request is answered once acknowledged), so the ledger's."""
        return self._tracker.in_flight

    def consumer_callbacks(self) -> dict[str, Callable[..., None]]:
        """The reports of asynchronous commits."""
        return {"on_commit": self.on_commit}

    def turn(self, consumer: Any, now: float) -> None:
        """Each turn of the poll loop: commit asynchronously what the ledger moved, once per interval."""
        if now < self._next or self._waiting:
            return
        self._next = now + self._interval_s
        offsets = self._tracker.commit_offsets()
        if offsets:
            self._waiting = True
            consumer.commit(offsets=offsets, asynchronous=True)

    def commit(self, consumer: Any, partitions: list[PartitionKey] | None = None) -> None:
        """Revoke and close: commit what is answered of ``partitions`` (default: all) now, and wait."""
        offsets = self._tracker.commit_offsets(partitions)
        if not offsets:
            return
        try:
            result = consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as exc:
            # Nothing is lost: the next owner, or this member after a restart, serves them again.
            self._metrics.commit_failures.inc()
            log.warning("commit of %d partitions failed: %s", len(offsets), exc)
            return
        self._accepted(result or offsets)

    def on_commit(self, error: KafkaError | None, partitions: list[TopicPartition]) -> None:
        """librdkafka's report of an asynchronous commit (served by ``poll``, in the poll thread)."""
        self._waiting = False
        if error is not None:
            # Nothing is lost: the same offsets (or later ones) are committed next time.
            self._metrics.commit_failures.inc()
            log.warning("commit failed: %s", error)
            return
        self._accepted(partitions)

    def _accepted(self, partitions: list[TopicPartition]) -> None:
        accepted = [tp for tp in partitions if tp.error is None]
        if len(accepted) < len(partitions):
            self._metrics.commit_failures.inc()
        self._tracker.committed(accepted)
        self._metrics.commits.inc()


class Transactions:
    """What the two threads of exactly-once tell each other; thread-safe. The poll thread (``TransactionCommits``)
    writes the group's generation and asks for transactions; the publisher thread (``ExactlyOnce``) reads the
    generation, takes the asks, says how many finished requests it holds and when each transaction cycle is over."""

    def __init__(self) -> None:
        self.generation: Any = None
        """The consumer's group generation, for ``send_offsets_to_transaction`` (zombie fencing): one reference,
        replaced whole by the poll thread."""
        self.held = 0
        """Finished requests the publisher holds for their transaction: one int, replaced whole by the publisher."""
        self.asked = threading.Event()
        """A transaction with everything committable now is asked for (a revoke, the close)."""
        self._cycles = threading.Condition()
        self._cycle_count = 0
        self._closed = False

    @property
    def closed(self) -> bool:
        """The publisher left: nothing more becomes durable."""
        return self._closed

    def ask(self, timeout_s: float) -> bool:
        """Ask for a transaction with everything committable now and wait for it (poll thread)."""
        with self._cycles:
            target = self._cycle_count + 2  # a cycle already running may have started before our requests
            self.asked.set()
            return self._cycles.wait_for(lambda: self._cycle_count >= target or self._closed, timeout_s)

    def cycle_done(self) -> None:
        """A transaction cycle is over: committed, aborted, or nothing to commit (publisher thread)."""
        with self._cycles:
            self._cycle_count += 1
            self._cycles.notify_all()

    def close(self) -> None:
        """The publisher leaves: whoever waits in ``ask`` is woken."""
        with self._cycles:
            self._closed = True
            self._cycles.notify_all()


class TransactionCommits:
    """The poll thread's side of exactly-once: the consumer itself commits nothing (see the module)."""

    def __init__(self, tracker: OffsetTracker, transactions: Transactions, timeout_s: float = 30.0) -> None:
        self._tracker = tracker
        self._transactions = transactions
        self._timeout_s = timeout_s

    @property
    def in_flight(self) -> int:
        """What flow control bounds: the ledger's, and the held requests (the ledger counts them finished, but they
        are not answered until their transaction commits)."""
        return self._tracker.in_flight + self._transactions.held

    def consumer_callbacks(self) -> dict[str, Callable[..., None]]:
        """None: the consumer commits nothing."""
        return {}

    def turn(self, consumer: Any, _now: float) -> None:
        """Each turn of the poll loop: read the group's generation for the next transaction."""
        self._read_generation(consumer)

    def commit(self, consumer: Any, _partitions: list[PartitionKey] | None = None) -> None:
        """Revoke and close: a transaction with everything committable now, under the generation as it is now,
        waited for."""
        self._read_generation(consumer)
        if not self._transactions.ask(self._timeout_s):
            log.warning("no transaction committed within %.0f s", self._timeout_s)

    def _read_generation(self, consumer: Any) -> None:
        """A consumer leaving the group (``close``) has no generation, and says so with a ``RuntimeError``: the last
        one read stays. Left to escape from a revoke, that error would end the callback half-way, and confluent-kafka
        turns it into a ``SystemError`` out of ``close()`` on Python 3.11 (seen in CI)."""
        try:
            self._transactions.generation = consumer.consumer_group_metadata()
        except RuntimeError as exc:
            log.debug("no group generation to read: %s", exc)
