"""The checkpoint: how an answered request becomes durable, the one thing the delivery modes do differently.

``publisher.Publisher`` produces every answer, follows every record until the broker has it, and hands the
answered requests to its checkpoint. Two checkpoints exist:

- ``commit.ConsumerCheckpoint`` (at-least-once): a request whose records were all acknowledged is answered; the
  commit tracker counts it finished and the consumer commits its offset (in the poll thread);
- ``transactions.TransactionCheckpoint`` (exactly-once): finished requests are held until they form a run from
  the last committed offset; then one transaction holds their answers and ``send_offsets_to_transaction`` of
  the new positions. A request is answered when its transaction commits.

A checkpoint is also the source's committer (``maybe_commit``, ``commit``: what the poll thread and a revoke
call), and says what the source's flow control bounds (``in_flight``: requests not yet answered for good). A
share group uses ``ConsumerCheckpoint`` over its own ledger (``share.ShareLedger``), whose finished requests
become the acknowledgements its source sends.
"""

from __future__ import annotations

from typing import Any, Protocol

from confluent_kafka import KafkaError

from kinference.consumer.request import Request
from kinference.consumer.types import PartitionKey


class Abort(Exception):
    """The open transaction cannot commit: it is aborted, and its requests are answered in the next one."""

    def __init__(self, error: KafkaError) -> None:
        super().__init__(error.str())
        self.error = error


class Transaction(Protocol):
    """Requests whose answers are produced together, and committed or aborted together (``Checkpoint.due``)."""

    requests: list[Request]

    def begin(self, producer: Any) -> None: ...

    def commit(self, producer: Any) -> None:
        """Make the answers produced since ``begin`` durable with the requests' offsets; raises ``Abort``."""

    def abort(self, producer: Any, error: KafkaError) -> str | None:
        """Abort it; the requests stay held for the next one. Returns why the service must stop, if it must."""


class Checkpoint(Protocol):
    replaces_producer: bool
    """A producer that failed for good is replaced (True), or stops the service (False: a transactional
    producer initialised again would fence the other instance of its id in turn)."""

    @property
    def in_flight(self) -> int:
        """Requests taken in and not yet answered for good: those the tracker follows, and the finished ones the
        checkpoint holds back from their answer. Flow control bounds this (``--max-in-flight``)."""

    def open(self, producer: Any) -> None:
        """Make the producer ready (exactly-once registers its transactional id). Publisher thread, at start."""

    def close(self) -> None:
        """The publisher leaves (its thread ended, or its stop deadline passed): nothing more becomes durable. Stop
        retrying, and wake whoever waits in ``commit``. Any thread."""

    def take(self, requests: list[Request]) -> list[Request]:
        """Finished requests (results or errors) in; those to answer at once out. The others are held."""

    def acknowledged(self, requests: list[Request]) -> None:
        """Every record answering these requests, produced outside a transaction, was acknowledged."""

    def due(self, now: float, final: bool) -> Transaction | None:
        """Held requests to answer now in one transaction, or None. ``final``: the last call before stopping."""

    # --- the source's committer (the poll thread)

    def maybe_commit(self, consumer: Any, now: float) -> None:
        """Each turn of the poll loop."""

    def commit(self, consumer: Any, partitions: list[PartitionKey] | None = None) -> None:
        """Revoke and close: make what is answered of ``partitions`` (default: all) durable now, and wait."""
