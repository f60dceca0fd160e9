"""Consumer lag: ``kinference_consumer_lag`` per assigned partition, the quantity autoscalers act on.

Lag here is the broker's end offset of the partition minus the group's committed offset: exactly what KEDA's
Kafka scaler computes, so an HPA on this metric and a KEDA ``ScaledObject`` scale on the same number. (Before
the group has committed anything in a partition, the committed offset counts as the partition's start, as
``auto.offset.reset=earliest`` reads it.)

It has its own thread and admin client, and asks the broker every ``interval_s``: the consumer's cached
watermarks only move with fetches, so they would freeze exactly while partitions are paused, which is when
lag matters. Two small requests per interval (ListOffsets, OffsetFetch), whatever the partition count.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable

from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

from kinference.consumer.ops.metrics import Metrics
from kinference.consumer.types import PartitionKey

log = logging.getLogger(__name__)


class LagMonitor:
    def __init__(
        self,
        admin_config: dict[str, str],
        group_id: str,
        partitions: Callable[[], set[PartitionKey]],
        metrics: Metrics,
        interval_s: float,
    ) -> None:
        self._admin: AdminClient | None = AdminClient({**admin_config})
        self._group_id = group_id
        self._partitions = partitions
        self._gauge = metrics.consumer_lag
        self._interval_s = interval_s
        self._timeout_s = max(1.0, min(10.0, interval_s))
        self._shown: set[PartitionKey] = set()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kinference-lag", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(self._timeout_s * 3 + 1)
        if not self._thread.is_alive():
            self._admin = None  # its connections end with the service, not at a later garbage collection

    def _run(self) -> None:
        while not self._stopping.wait(self._interval_s):
            try:
                self.refresh()
            except Exception as exc:  # the broker may be away: the gauge keeps its last value meanwhile
                log.debug("lag not refreshed: %r", exc)

    def refresh(self) -> None:
        keys = set(self._partitions())
        for topic, partition in self._shown - keys:
            with contextlib.suppress(KeyError):  # a partition never measured has no series
                self._gauge.remove(topic, str(partition))
        self._shown &= keys
        admin = self._admin
        if not keys or admin is None:  # None: stopped
            return
        tps = [TopicPartition(topic, partition) for topic, partition in sorted(keys)]
        ends = self._offsets(admin, tps, OffsetSpec.latest())
        starts = self._offsets(admin, tps, OffsetSpec.earliest())
        request = [ConsumerGroupTopicPartitions(self._group_id, tps)]
        future = admin.list_consumer_group_offsets(request, request_timeout=self._timeout_s)[self._group_id]
        committed = {(tp.topic, tp.partition): tp.offset for tp in future.result(self._timeout_s).topic_partitions
                     if tp.error is None}
        for key in keys & set(ends):
            position = committed.get(key, -1)
            if position < 0:
                position = starts.get(key, 0)
            self._gauge.labels(key[0], str(key[1])).set(max(0, ends[key] - position))
            self._shown.add(key)

    def _offsets(self, admin: AdminClient, tps: list[TopicPartition], spec: OffsetSpec) -> dict[PartitionKey, int]:
        futures = admin.list_offsets({tp: spec for tp in tps}, request_timeout=self._timeout_s)
        return {(tp.topic, tp.partition): future.result(self._timeout_s).offset for tp, future in futures.items()}
