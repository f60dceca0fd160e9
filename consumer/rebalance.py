"""Rebalances: what the member does when the group gives it partitions or takes them away.

Both kinds of protocol are handled, partition by partition:

- eager (``range``, ``roundrobin``): every rebalance revokes the whole assignment, then assigns the new one;
- incremental (``cooperative-sticky``, the default, and KIP-848's ``group.protocol=consumer``): only the
  partitions that move are revoked or assigned, with ``incremental_assign`` / ``incremental_unassign``. The
  other partitions keep being served through the rebalance: their waiting requests stay in the batcher and
  their in-flight work goes on.

A revoked partition is handed over cleanly: its requests that have not started are dropped (the next owner
serves them from the last commit), its started ones get ``rebalance_drain_ms`` to be answered, what is
answered is committed, and then its ledger is detached so that nothing it still holds can be committed. A
lost partition (the member was too late: another member owns it already) is dropped without a commit.

These callbacks run in the poll thread, inside ``consume()``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from confluent_kafka import TopicPartition

from kinference.consumer.commit import OffsetTracker
from kinference.consumer.config import ServiceConfig
from kinference.consumer.flow import FlowControl
from kinference.consumer.intake import Intake
from kinference.consumer.metrics import Metrics
from kinference.consumer.types import PartitionKey

log = logging.getLogger(__name__)


class Rebalance:
    def __init__(
        self,
        config: ServiceConfig,
        intake: Intake[OffsetTracker],
        flow: FlowControl,
        commit: Callable[[Any, list[PartitionKey]], None],
        metrics: Metrics,
    ) -> None:
        """``intake``: its commit ledger, and ``discard``, which takes the not-yet-started requests of partitions out
        of the batchers; ``commit(consumer, partitions)`` commits what is answered of them, synchronously."""
        self._tracker = intake.tracker
        self._flow = flow
        self._discard = intake.discard
        self._commit = commit
        self._metrics = metrics
        self._incremental = config.incremental_rebalancing
        self._drain_s = config.rebalance_drain_ms / 1000
        self.drain_until: float | None = None
        """Shutdown: no revoke waits past this ``time.monotonic()``."""
        self.partitions: set[PartitionKey] = set()
        self.joined = threading.Event()
        """Set at the first assignment, even an empty one: the member is in the group."""
        self.group_metadata: Any = None
        """The consumer's group generation, for ``send_offsets_to_transaction`` (zombie fencing). Read by the
        publisher thread: asking the consumer from there blocks while the poll thread is inside it."""

    def on_assign(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        keys = _keys(partitions)
        self._tracker.assign(keys)
        if self._incremental:
            consumer.incremental_assign(partitions)
            self.partitions |= set(keys)
        else:
            consumer.assign(partitions)
            self.partitions = set(keys)
        self._flow.assigned(consumer, partitions, len(self.partitions))
        self._read_generation(consumer)
        self._metrics.assigned_partitions.set(len(self.partitions))
        log.info("assigned %s", _names(keys))
        self.joined.set()

    def on_revoke(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        keys = _keys(partitions)
        self._read_generation(consumer)  # the commit below must carry it (exactly-once: KIP-447 fencing)
        dropped = self._discard(keys)
        self._tracker.abandon(dropped)
        self._metrics.rebalance_dropped.inc(len(dropped))
        wait_s = self._drain_s if self.drain_until is None else max(0.0, min(self._drain_s,
                                                                             self.drain_until - time.monotonic()))
        if not self._tracker.wait_idle(wait_s, keys):
            log.warning("revoke: in-flight requests of %s not answered within %.1f s; the next owner may answer "
                        "them again", _names(keys), wait_s)
        self._commit(consumer, keys)
        # Logged before the unassign: from then on the group may hand the partitions to the next owner before this
        # thread runs again, and a line written later would claim them past the hand-over.
        log.info("revoked %s (%d waiting requests left to the next owner)", _names(keys), len(dropped))
        self._forget(consumer, partitions, keys)

    def on_lost(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        """Taken away without a clean revoke: another member owns them already, so committing would be wrong."""
        keys = _keys(partitions)
        self._discard(keys)
        log.warning("lost %s", _names(keys))
        self._forget(consumer, partitions, keys)

    def _forget(self, consumer: Any, partitions: list[TopicPartition], keys: list[PartitionKey]) -> None:
        self._tracker.revoke(keys)
        if self._incremental:
            consumer.incremental_unassign(partitions)
        else:
            consumer.unassign()
        self.partitions -= set(keys)
        self._read_generation(consumer)
        self._flow.revoked(len(self.partitions))
        self._metrics.assigned_partitions.set(len(self.partitions))

    def _read_generation(self, consumer: Any) -> None:
        """``group_metadata``, the group's generation now. A consumer leaving the group (``close``) has none, and
        says so with a ``RuntimeError``: the last one read stays. Left to escape, that error would end the callback
        half-way, the partitions still counted as this member's, and confluent-kafka turns it into a ``SystemError``
        out of ``close()`` on Python 3.11 (seen in CI)."""
        try:
            self.group_metadata = consumer.consumer_group_metadata()
        except RuntimeError as exc:
            log.debug("no group generation to read: %s", exc)


def _keys(partitions: Iterable[TopicPartition]) -> list[PartitionKey]:
    return [(tp.topic, tp.partition) for tp in partitions]


def _names(keys: list[PartitionKey]) -> str:
    return ", ".join(f"{topic}[{partition}]" for topic, partition in keys) or "nothing"
