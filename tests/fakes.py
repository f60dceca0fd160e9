"""Fakes for unit tests of pure logic (never used by integration tests, which use a real broker)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from kinference.consumer.ledger.request import Request
from kinference.consumer.path.admission import Admission

_offsets = itertools.count()


class FakeRecord:
    """The accessors of confluent_kafka.Message that the decoder reads."""

    def __init__(self, value: bytes | None, headers: list | None = None, key: bytes | None = b"k",
                 topic: str = "requests", partition: int = 0, offset: int | None = None) -> None:
        self._value, self._headers, self._key = value, headers, key
        self._topic, self._partition = topic, partition
        self._offset = next(_offsets) if offset is None else offset

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def key(self) -> bytes | None:
        return self._key

    def value(self) -> bytes | None:
        return self._value

    def headers(self) -> list | None:
        return self._headers

    def timestamp(self) -> tuple[int, int]:
        return (0, 0)  # TIMESTAMP_NOT_AVAILABLE


def make_request(payload: Any = None, *, partition: int = 0, offset: int | None = None,
                 received: float = 0.0, deadline_ms: int | None = None, topic: str = "requests") -> Request:
    offset = next(_offsets) if offset is None else offset
    return Request(topic=topic, partition=partition, offset=offset, key=None, value=None, headers=[],
                   received=received, correlation_id=f"c{offset}", reply_topic="replies",
                   deadline_ms=deadline_ms, payload=payload)


def wait_for(predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    """Poll ``predicate`` until it holds or ``timeout_s`` passes; its last value (for threads under test)."""
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def admit(handler: Any, requests: list[Request]) -> None:
    """What a model's admission writes on ``requests`` (``admission.Admission``: each one's item and tokens, or its
    error), without a runner to queue them nor a publisher to answer them."""
    Admission("model", handler, lambda refused: None).put(requests, 0, lambda admitted: None)


@dataclass
class FakeModels:
    """The intake's downstream (``models.Models`` in the service): records what it is handed, each fetch in one
    ``take``."""

    admitted: list = field(default_factory=list)
    """The requests taken that the decoder did not fail: what the models' runners admit."""
    routed: list = field(default_factory=list)
    """Every request taken, in order."""
    takes: int = 0

    def take(self, requests: list) -> None:
        self.takes += 1
        self.routed.extend(requests)
        self.admitted.extend(request for request in requests if request.ok)

    def discard(self, partitions: list) -> list:
        return []


@dataclass
class FakeBatches:
    """A pipeline's batches (``stages.Batches``) from a function ``next_batch(timeout_s, only_full)``."""

    next_batch: Callable[..., list]

    def wake(self) -> None:
        pass

    def observe(self, work: int, seconds: float) -> None:
        pass


class FakeMessage:
    """The accessors of a produced confluent_kafka.Message that the tests read."""

    def __init__(self, topic: str, value: bytes | None, key: bytes | None, headers: Any, partition: int) -> None:
        self._fields = (topic, value, key, headers, partition)

    def topic(self) -> str:
        return self._fields[0]

    def value(self) -> bytes | None:
        return self._fields[1]

    def key(self) -> bytes | None:
        return self._fields[2]

    def headers(self) -> Any:
        return self._fields[3]

    def partition(self) -> int:
        return self._fields[4]


class FakeProducer:
    """librdkafka's producer contract as far as the publisher uses it, idempotent or transactional.

    Records are reported on ``poll`` and ``flush``; ``commit_transaction`` flushes, and raises an abortable error
    if a record of the transaction was refused; ``abort_transaction`` reports what it still holds as purged.
    ``fate(topic)`` is a record's delivery error (or None); ``refuse(value)`` the error ``produce`` raises at once;
    ``fatal`` a fatal error reported for everything; ``failures[name]`` what each call of a transactional method
    raises in turn (None: succeed); ``partitions[topic]`` the partition count ``list_topics`` gives (a record for a
    partition beyond it is refused, as the broker does). ``visible`` is what a read_committed reader sees."""

    instances: list[FakeProducer] = []

    def __init__(self, config: dict, fate: Callable = lambda topic: None, fatal: Any = None,
                 refuse: Callable = lambda value: None, failures: dict | None = None,
                 partitions: dict[str, int] | None = None) -> None:
        self.error_cb = config["error_cb"]
        self.transactional = "transactional.id" in config
        self.fate, self.fatal, self.refuse = fate, fatal, refuse
        self.failures = {name: list(errors) for name, errors in (failures or {}).items()}
        self.partitions = partitions or {}
        self.queued: list = []
        self.delivered: list[FakeMessage] = []
        self.calls: list[str] = []
        self.open: list[FakeMessage] = []
        self.refused_in_transaction = False
        self.offsets: list = []
        self.committed: list[tuple[list[tuple[str, bytes]], list[tuple[str, int, int]]]] = []
        """Each committed transaction: its records (topic, value) and its offsets (topic, partition, offset)."""
        self.committed_messages: list[FakeMessage] = []
        FakeProducer.instances.append(self)

    def produce(self, topic, value, key, headers=None, on_delivery=None, partition=-1):
        refused = self.refuse(value or b"")
        if refused is not None:
            raise KafkaException(refused)
        self.queued.append((FakeMessage(topic, value, key, headers, partition), on_delivery))

    def poll(self, timeout=0):
        if self.fatal is not None:
            self.error_cb(self.fatal)
        queued, self.queued = self.queued, []
        for message, on_delivery in queued:
            error = self.fatal or self._fate(message)
            if error is None:
                self.delivered.append(message)
                self.open.append(message)
            else:
                self.refused_in_transaction = True
            on_delivery(error, message)
        return 0

    def _fate(self, message: FakeMessage) -> Any:
        count = self.partitions.get(message.topic())
        if count is not None and message.partition() >= count:
            return KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART)
        return self.fate(message.topic())

    def flush(self, timeout=0):
        self.poll()
        return 0

    def purge(self, **_):
        pass

    def list_topics(self, topic=None, timeout=-1):
        count = self.partitions.get(topic)
        topics = {} if count is None else {topic: SimpleNamespace(error=None, partitions=dict.fromkeys(range(count)))}
        return SimpleNamespace(topics=topics)

    def __len__(self):
        return len(self.queued)

    # --- transactions

    def _call(self, name):
        self.calls.append(name)
        errors = self.failures.get(name)
        if errors:
            error = errors.pop(0)
            if error is not None:
                raise error

    def init_transactions(self, timeout):
        self._call("init")

    def begin_transaction(self):
        self._call("begin")
        self.open, self.offsets, self.refused_in_transaction = [], [], False

    def send_offsets_to_transaction(self, positions, metadata, timeout):
        self._call("send_offsets")
        self.generation = metadata
        self.offsets = [(tp.topic, tp.partition, tp.offset) for tp in positions]

    def commit_transaction(self, timeout):
        self.flush()
        if self.refused_in_transaction:
            raise KafkaException(KafkaError(KafkaError._INCONSISTENT, "a record was refused", txn_requires_abort=True))
        self._call("commit")
        self.committed.append(([(m.topic(), m.value()) for m in self.open], self.offsets))
        self.committed_messages += self.open
        self.open = []

    def abort_transaction(self, timeout):
        self._call("abort")
        queued, self.queued, self.open = self.queued, [], []
        for message, on_delivery in queued:
            on_delivery(KafkaError(KafkaError._PURGE_QUEUE), message)

    @property
    def visible(self) -> list[FakeMessage]:
        """What a read_committed reader sees: what each committed transaction held, or every delivered record."""
        return self.committed_messages if self.transactional else self.delivered
