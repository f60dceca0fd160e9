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

``ShareLedger`` keeps each record's outcome for the poll thread; ``ShareSource`` is that thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from enum import IntEnum
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource, ResourceType

from kinference.consumer.config import ServiceConfig
from kinference.consumer.ops.metrics import Metrics
from kinference.consumer.path.intake import Intake
from kinference.consumer.path.request import Request
from kinference.consumer.path.source import ConsumerErrors, PollLoop
from kinference.consumer.types import PartitionKey
from kinference.errors import BrokerError, ConfigError

log = logging.getLogger(__name__)

_POLL_S = 0.05



class AcknowledgeType(IntEnum):
    """librdkafka's acknowledgement types, as ``confluent_kafka.AcknowledgeType`` numbers them. Kept here so that
    kinference imports with a confluent-kafka older than the share consumer (its lowest supported release); only
    ``--group-type share`` needs one that has it."""

    ACCEPT = 1
    RELEASE = 2
    REJECT = 3


Acknowledgement = tuple[str, int, int, AcknowledgeType]


class ShareRecord:
    """A fetched record's place in the ledger (``Request.ledger``)."""

    __slots__ = ()
    attached = True


_RECORD = ShareRecord()


class ShareLedger:
    """The records this member acquired and has not acknowledged; thread-safe.

    ``track`` runs on the poll thread; ``finish`` and ``abandon`` on the publisher's (and at a revoke-free
    shutdown, the service's); ``take`` hands the outcomes back to the poll thread, which alone calls the share
    consumer (it is not thread-safe)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._acquired: set[tuple[str, int, int]] = set()
        self._outcomes: list[Acknowledgement] = []

    def track(self, key: PartitionKey, offset: int) -> ShareRecord:
        with self._cond:
            self._acquired.add((key[0], key[1], offset))
        return _RECORD

    def finish(self, requests: Iterable[Request]) -> None:
        """These records are answered: a reply is accepted, an error reply (with its dead letter) rejected."""
        self._settle((request, AcknowledgeType.ACCEPT if request.ok else AcknowledgeType.REJECT)
                     for request in requests)

    def abandon(self, requests: Iterable[Request]) -> None:
        """These records will not be answered here: the broker delivers them again."""
        self._settle((request, AcknowledgeType.RELEASE) for request in requests)

    def _settle(self, outcomes: Iterable[tuple[Request, AcknowledgeType]]) -> None:
        with self._cond:
            for request, kind in outcomes:
                key = (request.topic, request.partition, request.offset)
                if key in self._acquired:
                    self._acquired.discard(key)
                    self._outcomes.append((*key, kind))
            self._cond.notify_all()

    def take(self) -> list[Acknowledgement]:
        """The outcomes settled since the last call, for the share consumer."""
        with self._cond:
            outcomes, self._outcomes = self._outcomes, []
            return outcomes

    def release_all(self) -> list[Acknowledgement]:
        """Every settled outcome, and RELEASE for every record still unanswered: the last acknowledgements."""
        with self._cond:
            outcomes = self._outcomes + [(*key, AcknowledgeType.RELEASE) for key in sorted(self._acquired)]
            self._outcomes, self._acquired = [], set()
            return outcomes

    @property
    def in_flight(self) -> int:
        with self._cond:
            return len(self._acquired)

    def wait_settled(self, timeout_s: float) -> None:
        """Wait until some outcome is ready to acknowledge, or nothing is in flight."""
        with self._cond:
            if not self._outcomes and self._acquired:
                self._cond.wait(timeout_s)

    def wait_idle(self, timeout_s: float, partitions: Iterable[PartitionKey] | None = None) -> bool:
        """Wait until no record is in flight; False on timeout (a share group has no partitions of its own)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._acquired:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True


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
        intake: Intake[ShareLedger],
        metrics: Metrics,
        consumer_factory: Callable[[dict[str, Any]], Any] | None = None,
    ) -> None:
        self._config = config
        self._intake = intake
        self._ledger = intake.tracker
        self._metrics = metrics
        self.errors = ConsumerErrors(metrics, "share consumer")
        if consumer_factory is None:
            try:
                from confluent_kafka import ShareConsumer
            except ImportError as exc:
                raise ConfigError("--group-type share needs a confluent-kafka with the share consumer (2.16 is "
                                  "tested): pip install -U confluent-kafka") from exc
            consumer_factory = ShareConsumer
        # Any: confluent-kafka's ShareConsumer or a test's fake; its AcknowledgeType is this module's (numbers alike).
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
        for topic, partition, offset, kind in outcomes:
            try:
                self._consumer.acknowledge_offset(topic, partition, offset, int(kind))
            except Exception as exc:  # its lock expired: the broker has given the record to another member already
                log.warning("acknowledging %s[%d] offset %d as %s failed: %s", topic, partition, offset, kind.name,
                            exc)
                continue
            self._metrics.share_acknowledgements.labels(kind.name.lower()).inc()

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
