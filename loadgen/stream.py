"""The client side of a streamed generation (``Client.stream``): the records of one request, put in order.

The service writes a request's ``chat.completion.chunk`` records and then its final ``chat.completion``, each with
``kinference-event`` (``delta``/``final``), ``kinference-sequence`` (0, 1, 2... in one attempt) and
``kinference-attempt``. ``Stream`` turns them into the deltas a caller reads:

- a record seen already (a sequence number below the next one expected) is dropped;
- a record of a new attempt (the request's partition moved and another member generates it again) restarts the
  stream: the next ``Delta`` has ``restart`` set, and the caller drops the text it has so far; records of an attempt
  abandoned this way are dropped;
- a sequence number past the next one expected is a gap (a chunk lost): ``StreamGap``;
- the final ends the stream; its text must be what the deltas of its attempt added up to.

Iterate with ``for`` (``Client.stream``: the records come through a ``queue.Queue``) or ``async for``
(``Client.stream_async``: an ``asyncio.Queue``, so an event loop can run many streams without a thread each). Each
record comes with the time the client's reader took it from the consumer, which each ``Delta`` carries on.
"""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from kinference.loadgen.errors import ClientError, RequestTimeout
from kinference.loadgen.reply import Reply
from kinference.protocol import ATTEMPT, EVENT, SEQUENCE


class StreamGap(ClientError):
    """A chunk of the stream is missing: the sequence numbers jumped."""


@dataclass(frozen=True, slots=True)
class Delta:
    text: str
    restart: bool = False
    """The request is being generated again (a new attempt): drop the text read so far, this delta starts over."""
    received_at: float = 0.0
    """``time.monotonic()`` when the client's reader took the record of this delta from the consumer."""


Received = tuple[Any, float]
"""A record and the ``time.monotonic()`` when the client's reader took it."""


class Stream:
    """Iterate (``for`` over a ``queue.Queue``, ``async for`` over an ``asyncio.Queue``) for the ``Delta`` values;
    ``completion`` is the final ``chat.completion`` once the iteration ends. An error reply raises ``ReplyError``; no
    final by the deadline raises ``RequestTimeout``."""

    def __init__(self, records: queue.Queue[Received] | asyncio.Queue[Received], deadline: float,
                 correlation_id: str, sent_at: float, forget: Callable[[], object]) -> None:
        """``records``: the request's records as the client's reader gets them; ``forget`` stops that at a timeout."""
        self.correlation_id = correlation_id
        self._forget = forget
        self.completion: dict[str, Any] | None = None
        self.completed_at: float | None = None
        """``time.monotonic()`` when the client's reader took the final record."""
        self._records = records
        self._deadline = deadline
        self._sent_at = sent_at
        self._attempt: bytes | None = None
        self._abandoned: set[bytes] = set()
        self._next = 0
        self._text = ""
        self._restart = False
        """The next delta starts a new attempt."""

    def __iter__(self) -> Iterator[Delta]:
        if not isinstance(self._records, queue.Queue):
            raise TypeError("a stream of Client.stream_async is read with async for")
        while self.completion is None:
            delta = self._on(*self._take(self._records))
            if delta is not None:
                yield delta

    async def __aiter__(self) -> AsyncIterator[Delta]:
        if not isinstance(self._records, asyncio.Queue):
            raise TypeError("a stream of Client.stream is read with for, not async for")
        while self.completion is None:
            delta = self._on(*await self._take_async(self._records))
            if delta is not None:
                yield delta

    def _on(self, record: Any, received_at: float) -> Delta | None:
        """The delta a record adds, if any; None for a duplicate, a record of an abandoned attempt, or a final that
        adds no text."""
        headers = {name: raw for name, raw in (record.headers() or []) if raw is not None}
        if EVENT not in headers:  # an error answered before any generation: no attempt, no sequence
            Reply.from_record(record, self._sent_at, received_at).result()
            raise StreamGap(f"a reply without {EVENT} for a streamed request ({self.correlation_id})")
        attempt, sequence = headers.get(ATTEMPT), int(headers.get(SEQUENCE, b"0"))
        if attempt in self._abandoned:
            return None
        if attempt != self._attempt:
            if self._attempt is not None:
                self._abandoned.add(self._attempt)
                self._restart = True
            self._attempt, self._next, self._text = attempt, 0, ""
        if sequence < self._next:
            return None  # a duplicate
        if sequence > self._next:
            raise StreamGap(f"chunk {self._next} of {self.correlation_id} is missing (got {sequence})")
        self._next += 1
        text = self._read(record, headers, received_at)
        if text is None and not self._restart:
            return None
        delta = Delta(text or "", self._restart, received_at)
        self._restart = False
        return delta

    def _read(self, record: Any, headers: dict[str, bytes], received_at: float) -> str | None:
        if headers[EVENT] == b"delta":
            text: str = orjson.loads(record.value())["choices"][0]["delta"].get("content", "")
            self._text += text
            return text
        completion = Reply.from_record(record, self._sent_at, received_at).result()
        whole = completion["choices"][0]["message"]["content"]
        if not whole.startswith(self._text):
            raise StreamGap(f"the final text of {self.correlation_id} does not continue its chunks")
        self.completion, self.completed_at = completion, received_at
        # Without chunks (not streamed, or exactly-once), the final's text is the one delta.
        rest = whole[len(self._text):]
        return rest or None

    def _take(self, records: queue.Queue[Received]) -> Received:
        try:
            return records.get(timeout=self._left())
        except queue.Empty:
            raise self._timed_out() from None

    async def _take_async(self, records: asyncio.Queue[Received]) -> Received:
        if not records.empty():  # as the blocking get does: a record that is there is read, even past the deadline
            return records.get_nowait()
        try:
            return await asyncio.wait_for(records.get(), self._left())
        except TimeoutError:
            raise self._timed_out() from None

    def _left(self) -> float:
        return max(0.0, self._deadline - time.monotonic())

    def _timed_out(self) -> RequestTimeout:
        self._forget()
        return RequestTimeout(f"no final record within the timeout (correlation id {self.correlation_id})")
