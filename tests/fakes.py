"""Fakes for unit tests of pure logic (never used by integration tests, which use a real broker)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

from kinference.consumer.request import Request

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
