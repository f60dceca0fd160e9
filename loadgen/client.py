"""The request-reply client: send a request to kinference, get a future for its reply.

Reply routing (see docs/client.md): each client reads one partition of the reply topic by
``assign()`` (no consumer group, so no rebalance can move its replies to another process) and asks
the service to answer there with the ``kafka_replyPartition`` header. Several clients may share a
partition; each completes only the correlation ids it sent and drops the others. The partition is
read from its end offset taken *before* the first request is sent, so no reply can be missed.

One reader thread polls the reply consumer, completes futures, expires deadlines and serves the
producer's delivery reports; callers on any thread or event loop only produce and wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from functools import partial
from types import TracebackType
from typing import Any

import orjson
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from kinference.loadgen.errors import ClientClosed, ClientError, DeliveryFailed, RequestTimeout, TooManyPending
from kinference.loadgen.pending import ClientStats, Pending, PendingTable, settle
from kinference.loadgen.reply import Reply
from kinference.loadgen.stream import Received, Stream
from kinference.protocol import (
    BOOTSTRAP_SERVERS_ENV,
    CORRELATION_ID,
    DEADLINE_MS,
    EVENT,
    KAFKA_PROPERTIES_ENV,
    REPLY_TO,
    SPRING_REPLY_PARTITION,
    encode_deadline,
    encode_partition,
    parse_properties,
)

log = logging.getLogger(__name__)

_POLL_S = 0.02
_BATCH = 500
_SETTLE_GRACE_S = 2.0
"""How long a blocking call waits past its deadline for the reader thread to settle the future."""

_PRODUCER_DEFAULTS = {"linger.ms": "1", "acks": "all"}
_CONSUMER_DEFAULTS = {
    "enable.auto.commit": "false",
    "enable.partition.eof": "false",
    # Replies of an exactly-once service are visible only once their transaction commits; librdkafka's default,
    # spelled out because reading uncommitted replies would break that mode's promise.
    "isolation.level": "read_committed",
    "fetch.queue.backoff.ms": "10",
}


class Client:
    """``with Client("127.0.0.1:9092", "requests", "replies") as client: client.request(v)``.

    ``timeout_s`` is the default per-request timeout; with ``propagate_deadline`` the request also
    carries it as ``kinference-deadline-ms`` so the service skips work its caller no longer waits for.
    At most ``max_pending`` requests await replies at once: beyond that ``send`` waits for room
    (within the request's timeout) and then raises ``TooManyPending``. ``kafka`` goes to the client's
    producer and consumer (security, SASL), ``reply_consumer`` to its consumer only (on the embedded broker:
    ``fetch.wait.max.ms=10``, see ``kinference.consumer.brokers.broker.LOW_LATENCY_CONSUMER``).
    """

    def __init__(  # noqa: PLR0913 - public API (docs/client.md): keyword-only options, each with a default
        self,
        bootstrap_servers: str,
        request_topic: str,
        reply_topic: str,
        *,
        reply_partition: int | None = None,
        timeout_s: float = 30.0,
        max_pending: int = 10_000,
        recent_capacity: int = 100_000,
        propagate_deadline: bool = True,
        kafka: Mapping[str, str] | None = None,
        reply_consumer: Mapping[str, str] | None = None,
        metadata_timeout_s: float = 10.0,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if reply_partition is not None and reply_partition < 0:
            raise ValueError(f"reply_partition must be >= 0, got {reply_partition}")
        self.request_topic = request_topic
        self.reply_topic = reply_topic
        self.reply_partition = reply_partition
        self.timeout_s = timeout_s
        self.propagate_deadline = propagate_deadline
        self._bootstrap_servers = bootstrap_servers
        self._kafka = dict(kafka or {})
        self._reply_consumer = dict(reply_consumer or {})
        self._metadata_timeout_s = metadata_timeout_s
        self._pending = PendingTable(max_pending, recent_capacity)
        self._producer: Producer | None = None
        self._consumer: Consumer | None = None
        self._routing: list[tuple[str, bytes]] = []
        self._streams: dict[str, Callable[[Received], None]] = {}
        """Where the records of each streamed request go (``stream``), by correlation id, until its final."""
        self._stopping = threading.Event()
        self._reader: threading.Thread | None = None

    @classmethod
    def from_env(cls, request_topic: str, reply_topic: str, *, environ: Mapping[str, str] | None = None,
                 **options: Any) -> Client:
        """A client configured as ``kinference serve`` is: the brokers from ``KINFERENCE_BOOTSTRAP_SERVERS``
        (default ``127.0.0.1:9092``), the librdkafka properties (security, SASL, TLS) from ``KINFERENCE_KAFKA``
        (a JSON object or ``key=value`` pairs); ``kafka=`` entries among ``options`` go over those."""
        import os

        environ = os.environ if environ is None else environ
        kafka = {**parse_properties(environ.get(KAFKA_PROPERTIES_ENV, "")), **dict(options.pop("kafka", None) or {})}
        return cls(environ.get(BOOTSTRAP_SERVERS_ENV, "127.0.0.1:9092"), request_topic, reply_topic, kafka=kafka,
                   **options)

    # --- lifecycle

    def start(self) -> Client:
        """Check both topics exist, assign the reply partition at its end, start the reader thread."""
        if self._reader is not None:
            raise ClientError("client already started")
        common = {"bootstrap.servers": self._bootstrap_servers, **self._kafka}
        self._consumer = Consumer({**_CONSUMER_DEFAULTS, **common, **self._reply_consumer,
                                   # Required by librdkafka; never joined: the client only assigns.
                                   "group.id": f"kinference-client-{uuid.uuid4().hex}"})
        try:
            self.reply_partition = self._assign_reply_partition()
        except KafkaException as exc:
            self._consumer.close()
            raise ClientError(f"cannot read topic metadata from {self._bootstrap_servers}: {exc}") from exc
        except BaseException:
            self._consumer.close()
            raise
        self._producer = Producer({**_PRODUCER_DEFAULTS, **common})
        self._routing = [(REPLY_TO, self.reply_topic.encode()),
                         (SPRING_REPLY_PARTITION, encode_partition(self.reply_partition))]
        self._reader = threading.Thread(target=self._read_replies, name="kinference-client-reader", daemon=True)
        self._reader.start()
        log.info("client ready: requests to %s, replies from %s[%d]", self.request_topic, self.reply_topic,
                 self.reply_partition)
        return self

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop reading replies; requests still pending fail with ``ClientClosed``."""
        self._stopping.set()
        if self._reader is not None:
            self._reader.join(timeout_s)
        for entry in self._pending.close():
            settle(entry.future, error=ClientClosed("the client closed before the reply arrived"))
        if self._producer is not None:
            self._producer.flush(timeout_s)
        if self._consumer is not None:
            self._consumer.close()
        self._producer = self._consumer = None

    def __enter__(self) -> Client:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def stats(self) -> ClientStats:
        return self._pending.stats()

    # --- requests

    def send(self, value: Any, *, key: bytes | str | None = None, timeout_s: float | None = None,
             headers: Iterable[tuple[str, bytes]] = ()) -> Future[Reply]:
        """Produce one request and return the future of its ``Reply``.

        ``value`` is sent as is when it is bytes, else as JSON. The future fails with
        ``RequestTimeout`` when no reply arrives within ``timeout_s`` (default: the client's).
        """
        return self._send(value, key, headers, self._deadline(timeout_s), block=True)

    def request(self, value: Any, *, key: bytes | str | None = None, timeout_s: float | None = None,
                headers: Iterable[tuple[str, bytes]] = ()) -> Reply:
        """Blocking ``send``: the reply (ok or error: see ``Reply.result()``)."""
        deadline = self._deadline(timeout_s)
        return _wait(self._send(value, key, headers, deadline, block=True), deadline)

    async def request_async(self, value: Any, *, key: bytes | str | None = None,
                            timeout_s: float | None = None,
                            headers: Iterable[tuple[str, bytes]] = ()) -> Reply:
        """``send`` for asyncio: never blocks the event loop, even when ``max_pending`` is reached."""
        deadline = self._deadline(timeout_s)
        try:
            future = self._send(value, key, headers, deadline, block=False)
        except TooManyPending:
            future = await asyncio.to_thread(self._send, value, key, headers, deadline, True)
        return await asyncio.wrap_future(future)

    def request_many(self, values: Iterable[Any], *, timeout_s: float | None = None
                     ) -> list[Reply | ClientError]:
        """Send all ``values``, then wait for all replies. Each slot holds the reply or the
        ``ClientError`` of that request (e.g. ``RequestTimeout``), in the order of ``values``."""
        sent: list[tuple[Future[Reply] | ClientError, float]] = []
        for value in values:
            deadline = self._deadline(timeout_s)
            try:
                sent.append((self._send(value, None, (), deadline, block=True), deadline))
            except ClientError as exc:
                sent.append((exc, deadline))
        outcomes: list[Reply | ClientError] = []
        for future, deadline in sent:
            try:
                outcomes.append(future if isinstance(future, ClientError) else _wait(future, deadline))
            except ClientError as exc:
                outcomes.append(exc)
        return outcomes

    def stream(self, value: dict[str, Any], *, key: bytes | str | None = None, timeout_s: float | None = None,
               headers: Iterable[tuple[str, bytes]] = ()) -> Stream:
        """Send a generation request (an OpenAI chat-completions body, sent with ``"stream": true``) and return its
        ``Stream``: iterate for the deltas, in order, duplicates dropped, restarted when the request is generated
        again; ``StreamGap`` when a chunk is missing. ``Stream.completion`` is the final ``chat.completion``."""
        records: queue.Queue[Received] = queue.Queue()
        return self._open_stream(value, key, headers, self._deadline(timeout_s), (records, records.put))

    async def stream_async(self, value: dict[str, Any], *, key: bytes | str | None = None,
                           timeout_s: float | None = None, headers: Iterable[tuple[str, bytes]] = ()) -> Stream:
        """``stream`` for asyncio: read the returned ``Stream`` with ``async for``; never blocks the event loop."""
        deadline = self._deadline(timeout_s)
        records: asyncio.Queue[Received] = asyncio.Queue()
        channel = (records, partial(_put_threadsafe, asyncio.get_running_loop(), records))
        try:
            return self._open_stream(value, key, headers, deadline, channel, block=False)
        except TooManyPending:
            return await asyncio.to_thread(self._open_stream, value, key, headers, deadline, channel)

    def _open_stream(self, value: dict[str, Any], key: bytes | str | None, headers: Iterable[tuple[str, bytes]],
                     deadline: float, channel: tuple[Any, Callable[[Received], None]], block: bool = True) -> Stream:
        """``channel``: the stream's queue, and how the reader thread puts a record in it."""
        correlation_id = uuid.uuid4().hex
        records, put = channel
        self._streams[correlation_id] = put  # before the request exists: no record of it can come earlier
        try:
            self._send_as(correlation_id, {**value, "stream": True}, key, headers, (deadline, block))
        except BaseException:
            self._streams.pop(correlation_id, None)
            raise
        return Stream(records, deadline, correlation_id, time.monotonic(),
                      lambda: self._streams.pop(correlation_id, None))

    def _deadline(self, timeout_s: float | None) -> float:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        return time.monotonic() + timeout_s

    def _send(self, value: Any, key: bytes | str | None, headers: Iterable[tuple[str, bytes]],
              deadline: float, block: bool) -> Future[Reply]:
        return self._send_as(uuid.uuid4().hex, value, key, headers, (deadline, block))

    def _send_as(self, correlation_id: str, value: Any, key: bytes | str | None, headers: Iterable[tuple[str, bytes]],
                 timing: tuple[float, bool]) -> Future[Reply]:
        """``timing``: the deadline (``time.monotonic()``) and whether to wait for room under ``max_pending``."""
        deadline, block = timing
        if self._producer is None or self._stopping.is_set():
            raise ClientClosed("the client is not started or already closed")
        # bytes() of a bytearray or memoryview: the producer takes read-only bytes only (TypeError otherwise).
        payload = value if isinstance(value, bytes) else bytes(value) if isinstance(value, bytearray | memoryview) \
            else orjson.dumps(value)
        record_headers: list[tuple[str, str | bytes | None]] = [(CORRELATION_ID, correlation_id.encode()),
                                                                *self._routing, *headers]
        if self.propagate_deadline:
            epoch_ms = int((time.time() + deadline - time.monotonic()) * 1000)
            record_headers.append((DEADLINE_MS, encode_deadline(epoch_ms)))
        entry = self._pending.add(correlation_id, deadline, block)
        try:
            self._producer.produce(self.request_topic, payload, key, headers=record_headers,
                                   on_delivery=partial(self._delivered, correlation_id))
        except (BufferError, KafkaException) as exc:
            self._pending.discard(correlation_id)
            raise DeliveryFailed(f"cannot produce to {self.request_topic}: {exc}") from exc
        return entry.future

    # --- the reader thread

    def _read_replies(self) -> None:
        assert self._consumer is not None and self._producer is not None
        try:
            while not self._stopping.is_set():
                # poll() returns as soon as a reply is there; consume(n, t) would wait out t unless n
                # records came. Then take whatever else is already fetched without waiting.
                first = self._consumer.poll(self._poll_timeout())
                if first is not None:
                    for record in (first, *self._consumer.consume(_BATCH, 0)):
                        self._on_record(record)
                self._producer.poll(0)
                for entry in self._pending.expire(time.monotonic()):
                    settle(entry.future, error=RequestTimeout(
                        f"no reply within {entry.deadline - entry.sent_at:.3f} s "
                        f"(correlation id {entry.correlation_id})"))
        except Exception as exc:
            # Without this thread no future would ever settle: fail them all now, loudly.
            log.exception("reply reader failed; the client is closed")
            self._stopping.set()
            for entry in self._pending.close():
                settle(entry.future, error=ClientClosed(f"the reply reader failed: {exc}"))

    def _poll_timeout(self) -> float:
        next_deadline = self._pending.next_deadline()
        if next_deadline is None:
            return _POLL_S
        return min(_POLL_S, max(0.0, next_deadline - time.monotonic()))

    def _on_record(self, record: Any) -> None:
        received_at = time.monotonic()
        if record.error() is not None:
            # librdkafka looks up the coordinator of the group.id it requires, which this client never joins: a
            # principal without ACLs on that group (none are needed, docs/security.md) is refused, harmlessly.
            unused_group = record.error().code() == KafkaError.GROUP_AUTHORIZATION_FAILED
            log.log(logging.DEBUG if unused_group else logging.WARNING, "reply consumer: %s", record.error())
            return
        correlation_id = _correlation_id(record)
        if correlation_id and (put := self._streams.get(correlation_id)) is not None:
            put((record, received_at))
            if _is_chunk(record):
                return  # the final, or an error reply, ends the request
            self._streams.pop(correlation_id, None)
        entry = self._pending.take(correlation_id) if correlation_id else None
        if entry is not None:
            settle(entry.future, Reply.from_record(record, entry.sent_at, received_at))

    def _delivered(self, correlation_id: str, err: KafkaError | None, _record: Any) -> None:
        if err is None:
            return
        entry: Pending | None = self._pending.discard(correlation_id)
        if entry is not None:
            settle(entry.future, error=DeliveryFailed(f"request to {self.request_topic} failed: {err}"))

    def _assign_reply_partition(self) -> int:
        """Choose the reply partition and assign it at its current end offset."""
        assert self._consumer is not None
        # Metadata for all topics: asking for one unknown topic would auto-create it on some brokers.
        metadata = self._consumer.list_topics(timeout=self._metadata_timeout_s)
        for topic in (self.request_topic, self.reply_topic):
            if topic not in metadata.topics or metadata.topics[topic].error is not None:
                raise ClientError(f"topic {topic!r} does not exist on {self._bootstrap_servers}; create it "
                                  "first (kinference does not rely on topic auto-creation)")
        partitions = sorted(metadata.topics[self.reply_topic].partitions)
        partition = random.choice(partitions) if self.reply_partition is None else self.reply_partition
        if partition not in partitions:
            raise ClientError(f"reply topic {self.reply_topic!r} has partitions {partitions}, not {partition}")
        self._consumer.assign([TopicPartition(self.reply_topic, partition, self._end_offset(partition))])
        return partition

    def _end_offset(self, partition: int) -> int:
        """The reply partition's end offset, asked again while its leader moves (a new topic, a broker restart).

        Brokers may report an end offset below the true one (Tansu, for multi-record batches): the client then
        reads a few old replies and drops them as unmatched; it never starts too late."""
        assert self._consumer is not None
        deadline = time.monotonic() + self._metadata_timeout_s
        while True:
            try:
                return self._consumer.get_watermark_offsets(
                    TopicPartition(self.reply_topic, partition), timeout=self._metadata_timeout_s, cached=False)[1]
            except KafkaException as exc:
                if exc.args[0].code() not in _LEADER_MOVING or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


_LEADER_MOVING = {KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
                  KafkaError.UNKNOWN_TOPIC_OR_PART}
"""What a broker answers while a partition's leader is being elected (just after the topic's creation)."""


def _put_threadsafe(loop: asyncio.AbstractEventLoop, records: asyncio.Queue[Received], item: Received) -> None:
    """From the reader thread into an event loop's queue; dropped when that loop has closed (its caller is gone)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(records.put_nowait, item)


def _is_chunk(record: Any) -> bool:
    return any(name == EVENT and raw == b"delta" for name, raw in record.headers() or [])


def _correlation_id(record: Any) -> str | None:
    for name, raw in record.headers() or []:
        if name == CORRELATION_ID and raw is not None:
            correlation_id: str = raw.decode("utf-8", "replace")
            return correlation_id
    return None


def _wait(future: Future[Reply], deadline: float) -> Reply:
    """The future's reply; the reader thread settles it by ``deadline``, the grace covers its lag."""
    try:
        return future.result(timeout=max(0.0, deadline - time.monotonic()) + _SETTLE_GRACE_S)
    except FutureTimeout as exc:
        if future.done():  # the request's own RequestTimeout (a TimeoutError too)
            raise
        raise RequestTimeout("no reply and the reply reader did not settle the request in time") from exc
