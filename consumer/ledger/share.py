"""A share group's ledger (KIP-932, ``group_type=share``): the records this member acquired, each acknowledged once
it is answered, as a consumer group's ledger (``commit``) commits an offset only then.

- ACCEPT once its reply is acknowledged by the broker;
- REJECT once its error reply and dead letter are (a poison record is never delivered again), or once it is
  unanswerable;
- RELEASE when it is left unanswered (shutdown, a dead publisher): the broker delivers it again, to any member.

The share group's poll thread (``path.share.ShareSource``) takes the outcomes and acknowledges them; the broker side
of share groups, and what librdkafka's preview lacks, is told there.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Container, Iterable, Sequence
from enum import IntEnum

from kinference.consumer.ledger.request import Request
from kinference.consumer.types import PartitionKey


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

    def track_fetch(self, records: Sequence[tuple[PartitionKey, int]]) -> list[ShareRecord]:
        """Register one fetch's acquired records under one lock."""
        with self._cond:
            self._acquired.update((key[0], key[1], offset) for key, offset in records)
        return [_RECORD] * len(records)

    def finish(self, requests: Iterable[Request], failed: Container[Request] = ()) -> None:
        """These records are answered: a reply is accepted, an error reply (with its dead letter) rejected, whether
        the error is the request's own or the delivery's (``failed``: a missing reply partition, a result too large,
        unanswerable)."""
        self._settle((request, AcknowledgeType.ACCEPT if request.ok and request not in failed
                      else AcknowledgeType.REJECT) for request in requests)

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
