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
from collections.abc import Iterable
from typing import Any

from confluent_kafka import TopicPartition

from kinference.consumer.config import ServiceConfig
from kinference.consumer.ledger.commit import OffsetTracker
from kinference.consumer.ledger.commits import Commits
from kinference.consumer.ops.metrics import Metrics
from kinference.consumer.path.flow import FlowControl
from kinference.consumer.path.intake import Intake
from kinference.consumer.types import PartitionKey

log = logging.getLogger(__name__)


class Rebalance:
    def __init__(
        self,
        config: ServiceConfig,
        intake: Intake,
        tracker: OffsetTracker,
        flow: FlowControl,
        commits: Commits,
        metrics: Metrics,
    ) -> None:
        """``intake``: its ``discard``, which takes the not-yet-started requests of partitions out of the batchers;
        ``tracker``: the commit ledger the intake tracks them in; ``commits.commit(consumer, partitions)`` commits
        what is answered of them, and waits."""
        self._tracker = tracker
        self._flow = flow
        self._intake = intake
        self._commits = commits
        self._metrics = metrics
        self._incremental = config.incremental_rebalancing
        self._drain_s = config.rebalance_drain_ms / 1000
        self.drain_until: float | None = None
        """Shutdown: no revoke waits past this ``time.monotonic()``."""
        self.partitions: set[PartitionKey] = set()
        self.joined = threading.Event()
        """Set at the first assignment, even an empty one: the member is in the group."""

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
        self._metrics.assigned_partitions.set(len(self.partitions))
        log.info("assigned %s", _names(keys))
        self.joined.set()

    def on_revoke(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        keys = _keys(partitions)
        dropped = self._intake.discard(keys)
        self._tracker.abandon(dropped)
        self._metrics.rebalance_dropped.inc(len(dropped))
        wait_s = self._drain_s if self.drain_until is None else max(0.0, min(self._drain_s,
                                                                             self.drain_until - time.monotonic()))
        if not self._tracker.wait_idle(wait_s, keys):
            log.warning("revoke: in-flight requests of %s not answered within %.1f s; the next owner may answer "
                        "them again", _names(keys), wait_s)
        self._commits.commit(consumer, keys)
        # Logged before the unassign: from then on the group may hand the partitions to the next owner before this
        # thread runs again, and a line written later would claim them past the hand-over.
        log.info("revoked %s (%d waiting requests left to the next owner)", _names(keys), len(dropped))
        self._forget(consumer, partitions, keys)

    def on_lost(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        """Taken away without a clean revoke: another member owns them already, so committing would be wrong."""
        keys = _keys(partitions)
        self._intake.discard(keys)
        log.warning("lost %s", _names(keys))
        self._forget(consumer, partitions, keys)

    def _forget(self, consumer: Any, partitions: list[TopicPartition], keys: list[PartitionKey]) -> None:
        self._tracker.revoke(keys)
        if self._incremental:
            consumer.incremental_unassign(partitions)
        else:
            consumer.unassign()
        self.partitions -= set(keys)
        self._flow.revoked(len(self.partitions))
        self._metrics.assigned_partitions.set(len(self.partitions))


def _keys(partitions: Iterable[TopicPartition]) -> list[PartitionKey]:
    return [(tp.topic, tp.partition) for tp in partitions]


def _names(keys: list[PartitionKey]) -> str:
    return ", ".join(f"{topic}[{partition}]" for topic, partition in keys) or "nothing"
