"""The control topic (``--control-topic``): cancels of generations, read by every member.

A cancel is a record whose value is ``{"cancel": "<correlation id>"}``. Every member reads every partition of the
topic from its end when it starts (no consumer group: each member must see each cancel, whichever member generates
the request), and hands each correlation id to its generative models; the one that holds the request stops it, and
its final record says ``finish_reason: cancelled``. A cancel of a request no member holds (answered already, or not
consumed yet) does nothing: a cancel is not remembered.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import orjson
from confluent_kafka import OFFSET_END, Consumer, KafkaException, TopicPartition

log = logging.getLogger(__name__)

_POLL_S = 0.1
_METADATA_TIMEOUT_S = 10.0


def read_cancel(value: bytes | None) -> str | None:
    """The correlation id a control record cancels; None for anything else (logged, skipped)."""
    try:
        document = orjson.loads(value or b"")
    except orjson.JSONDecodeError:
        return None
    cancel = document.get("cancel") if isinstance(document, dict) else None
    return cancel if isinstance(cancel, str) and 0 < len(cancel) <= 256 else None


class ControlReader:
    """A thread reading the control topic; ``cancel(correlation_id)`` gets each cancel."""

    def __init__(self, consumer_config: dict[str, Any], topic: str, cancel: Callable[[str], None]) -> None:
        config = {key: value for key, value in consumer_config.items()
                  if not key.startswith(("group.", "partition.assignment", "session.", "heartbeat."))}
        self._consumer = Consumer({**config, "group.id": "kinference-control-unused", "enable.auto.commit": False})
        self._topic = topic
        self._cancel = cancel
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kinference-control", daemon=True)

    def start(self) -> None:
        """Assign every partition at its end (so that old cancels are not replayed), then read in a thread."""
        metadata = self._consumer.list_topics(self._topic, timeout=_METADATA_TIMEOUT_S).topics.get(self._topic)
        if metadata is None or metadata.error is not None:
            raise KafkaException(metadata.error if metadata is not None else f"no topic {self._topic}")
        self._consumer.assign([TopicPartition(self._topic, p, OFFSET_END) for p in metadata.partitions])
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(_POLL_S * 20)
        if not self._thread.is_alive():
            self._consumer.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while not self._stopping.is_set():
            for record in self._consumer.consume(500, _POLL_S):
                if record.error() is not None:
                    log.warning("control topic: %s", record.error())
                    continue
                correlation_id = read_cancel(record.value())
                if correlation_id is None:
                    log.warning("control topic %s[%d] offset %d: not a cancel ({\"cancel\": \"<correlation id>\"})",
                                record.topic(), record.partition(), record.offset())
                    continue
                self._cancel(correlation_id)
