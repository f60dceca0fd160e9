"""Share groups (KIP-932, ``group_type=share``): members share partitions, and each record is acknowledged.

A consumer group gives each partition to one member and commits offsets; a share group lets any number of members
read the same partitions (so a group scales past its partition count) and the broker tracks each record: a member
*acquires* the records it fetches, for ``group.share.record.lock.duration.ms`` (30 s by default), and
acknowledges each one. kinference acknowledges a record only once it is answered, as it commits an offset only
then in a consumer group:

- ACCEPT once its reply is acknowledged by the broker;
- REJECT once its error reply and dead letter are (a poison record is never delivered again), or once it is
  unanswerable (``publisher``: its records refused for good; the member goes on);
- RELEASE when it is left unanswered (shutdown, a dead publisher): the broker delivers it again, to any member,
  up to ``group.share.delivery.count.limit`` times (5 by default), then archives it.

A member that dies holds its records until its session or the locks expire; then they go to the others.

What librdkafka's share consumer (confluent-kafka 2.16, a preview) lacks, and what it costs:
- No lock renewal: every record of a fetch must be answered within the lock duration, or the broker hands it to
  another member too (two replies) and this member's late acknowledgement fails.
- In explicit acknowledgement every record of one fetch must be acknowledged before the next fetch: the records
  in flight are one fetch's, and ``max_in_flight`` and partition pauses do not apply. ``max.poll.records`` is
  not honoured by this preview: a fetch holds what the broker returns.
- No transactional acknowledgement: exactly-once is refused with share groups (``config``).
- No assignment: lag metrics, which read committed offsets, are not reported.

``ledger.share.ShareLedger`` keeps each record's outcome for the poll thread; ``ShareSource`` is that thread.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource, ResourceType

from kinference.consumer.config import ServiceConfig
from kinference.consumer.ledger.share import ShareLedger
from kinference.consumer.ops.metrics import Metrics
from kinference.consumer.path.intake import Intake
from kinference.consumer.path.source import ConsumerErrors, PollLoop
from kinference.errors import BrokerError, ConfigError

log = logging.getLogger(__name__)

_POLL_S = 0.05


def set_share_group_start(config: ServiceConfig, timeout_s: float = 30.0) -> None:
    """Set the group's ``share.auto.offset.reset`` (where a new share group starts: Kafka's default is latest,
    which would skip the requests written before the first member joined) to the consumer's
    ``auto.offset.reset``. The service calls it before it starts anything; ``BrokerError`` if the broker refuses."""
    admin = AdminClient({"bootstrap.servers": config.bootstrap_servers, **config.admin_config()})
    entry = ConfigEntry("share.auto.offset.reset", config.share_auto_offset_reset,
                        incremental_operation=AlterConfigOpType.SET)
    resource = ConfigResource(ResourceType.GROUP, config.group_id, incremental_configs=[entry])
    try:
        for future in admin.incremental_alter_configs([resource], request_timeout=timeout_s).values():
            future.result(timeout_s)
    except KafkaException as exc:
        error = exc.args[0]
        needs = (" (a share group member needs AlterConfigs on its group: docs/security.md#acls)"
                 if error.code() == KafkaError.GROUP_AUTHORIZATION_FAILED else "")
        raise BrokerError(f"cannot set share.auto.offset.reset of share group {config.group_id!r}: "
                          f"{error.str()}{needs}") from exc


class ShareSource:
    """The poll thread of a share group member: fetch, take in (``intake``), then acknowledge each record of the
    fetch as it is answered; the next fetch comes once all of them are (the share consumer refuses it before).
    A ``source.MemberSource`` like ``source.Source``, whose poll thread's lifecycle it shares (``source.PollLoop``)."""

    def __init__(
        self,
        config: ServiceConfig,
        intake: Intake,
        ledger: ShareLedger,
        metrics: Metrics,
        consumer_factory: Callable[[dict[str, Any]], Any] | None = None,
    ) -> None:
        self._config = config
        self._intake = intake
        self._ledger = ledger
        self._metrics = metrics
        self.errors = ConsumerErrors(metrics, "share consumer")
        if consumer_factory is None:
            try:
                from confluent_kafka import ShareConsumer
            except ImportError as exc:
                raise ConfigError("--group-type share needs a confluent-kafka with the share consumer (2.16 is "
                                  "tested): pip install -U confluent-kafka") from exc
            consumer_factory = ShareConsumer
        # Any: confluent-kafka's ShareConsumer or a test's fake; its AcknowledgeType is the ledger's (numbers alike).
        self._consumer: Any = consumer_factory({**config.share_consumer_config(), "error_cb": self.errors.on_client})
        self._loop = PollLoop("kinference-share-source", self.errors, self._poll_once, self._close_consumer)
        self._draining = threading.Event()
        self.joined = threading.Event()
        """Set once the first fetch came back: the member is in the share group."""

    def start(self) -> None:
        self._consumer.subscribe(list(self._config.request_topics))
        self._loop.start()

    def drain(self, timeout_s: float) -> None:
        """Stop fetching; the records of the last fetch are still answered and acknowledged."""
        self._draining.set()
        self._loop.wait_paused(timeout_s)

    def close(self, deadline: float) -> None:
        """Acknowledge what is answered, release what is not (another member gets it at once), leave the group."""
        self._loop.close(deadline)

    @property
    def alive(self) -> bool:
        return self._loop.alive

    @property
    def paused(self) -> bool:
        return self._draining.is_set()

    # --- the poll thread

    def _poll_once(self) -> None:
        self._acknowledge(self._ledger.take())
        if self._draining.is_set():
            self._loop.paused_for_good.set()  # no fetch after this one: what is in flight is answered and acknowledged
        if self._ledger.in_flight:
            if self._intake.waiting:  # records the byte budget had no room for: decoded as answers give bytes back
                self._intake.take([], self.errors.on_record)
            self._ledger.wait_settled(_POLL_S)
            return
        if self._draining.is_set():
            self._loop.closing.wait(_POLL_S)
            return
        records = list(self._consumer.poll(_POLL_S))  # also sends the acknowledgements made since the last one
        self.joined.set()
        self.errors.broker_up = True
        self._intake.take(records, self.errors.on_record)

    def _acknowledge(self, outcomes: list[Any]) -> None:
        acknowledged: Counter[str] = Counter()
        for topic, partition, offset, kind in outcomes:
            try:
                self._consumer.acknowledge_offset(topic, partition, offset, int(kind))
            except Exception as exc:  # its lock expired: the broker has given the record to another member already
                log.warning("acknowledging %s[%d] offset %d as %s failed: %s", topic, partition, offset, kind.name,
                            exc)
                continue
            acknowledged[kind.name.lower()] += 1
        for kind_name, count in acknowledged.items():  # observed per turn, not per record
            self._metrics.share_acknowledgements.labels(kind_name).inc(count)

    def _close_consumer(self) -> None:
        if self.errors.fatal is None:
            try:
                self._acknowledge(self._ledger.release_all())
                self._consumer.commit_sync(10)
            except KafkaException as exc:
                # Nothing is lost: unacknowledged records go back to the group when their locks expire.
                log.warning("acknowledging at close failed: %s", exc)
        try:
            self._consumer.close()  # leaves the share group
        except KafkaException as exc:
            log.warning("closing the share consumer failed: %s", exc)
        log.info("share consumer closed")
