"""Flow control: at most ``max_in_flight`` requests consumed and not yet answered (committed, in exactly-once), and
at most ``max_in_flight_bytes`` of what they hold decoded (``ledger.budget.ByteBudget``).

Above either, every assigned partition pauses; they resume at ``resume_in_flight`` requests and half the byte
budget. The poll thread keeps polling while paused, so the member never leaves the group, and memory stays bounded
whatever the input rate. Draining (shutdown) pauses for good.
"""

from __future__ import annotations

import logging
from typing import Any

from confluent_kafka import TopicPartition

from kinference.consumer.ledger.budget import ByteBudget
from kinference.consumer.ops.metrics import Metrics

log = logging.getLogger(__name__)


class FlowControl:
    def __init__(self, max_in_flight: int, resume_in_flight: int, metrics: Metrics,
                 budget: ByteBudget | None = None) -> None:
        """``budget``: the bytes in flight (by default, no bound on them)."""
        self._max = max_in_flight
        self._resume = resume_in_flight
        self._budget = budget or ByteBudget.unbounded()
        self._metrics = metrics
        self.paused = False
        self.draining = False

    def update(self, consumer: Any, in_flight: int) -> None:
        """Called by the poll thread after each poll."""
        self._metrics.in_flight.set(in_flight)
        held = self._budget.held
        self._metrics.in_flight_bytes.set(held)
        if not self.paused and (self.draining or in_flight >= self._max or self._budget.full()):
            assignment = consumer.assignment()
            consumer.pause(assignment)
            self.paused = True
            self._metrics.paused_partitions.set(len(assignment))
            log.debug("paused: %d in flight, %d bytes", in_flight, held)
        elif self.paused and not self.draining and in_flight <= self._resume and held <= self._budget.max_bytes // 2:
            assignment = consumer.assignment()
            consumer.resume(assignment)
            # librdkafka notices a resume only at its next fetch-loop wake-up (about 1 s later); a seek to the
            # position the application has consumed up to starts the fetch at once, and refetches exactly what
            # pause() discarded.
            for tp in consumer.position(assignment):
                if tp.offset >= 0:
                    consumer.seek(tp)
            self.paused = False
            self._metrics.paused_partitions.set(0)
            log.debug("resumed: %d in flight", in_flight)

    def assigned(self, consumer: Any, partitions: list[TopicPartition], owned: int) -> None:
        """Newly assigned partitions join the current state: paused while the rest are, else fetching. Resumed
        explicitly: librdkafka keeps a partition's pause across an unassign, so a partition this member paused
        before a rebalance and gets back after it would otherwise stay paused for good. ``owned``: the partitions
        assigned now, these included."""
        if self.paused:
            consumer.pause(partitions)
            self._metrics.paused_partitions.set(owned)
        else:
            consumer.resume(partitions)

    def revoked(self, owned: int) -> None:
        """``owned``: the partitions still assigned. Counted by the caller, not asked of the consumer: this runs
        in a rebalance callback, and there ``assignment()`` (a request to librdkafka's group thread) can wait
        forever when ``close()`` ran the callback: seen here as a hang at shutdown, once in a CI run; librdkafka
        issue 4041 is the same hang with ``rd_kafka_rebalance_protocol()``."""
        if self.paused:
            self._metrics.paused_partitions.set(owned)
