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
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator
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


class Stream:
    """Iterate for the ``Delta`` values; ``completion`` is the final ``chat.completion`` once the iteration ends. An
    error reply raises ``ReplyError``; no final by the deadline raises ``RequestTimeout``."""

    def __init__(self, records: queue.Queue[Any], deadline: float, correlation_id: str, sent_at: float,
                 forget: Callable[[], object]) -> None:
        """``records``: the request's records as the client's reader gets them; ``forget`` stops that at a timeout."""
        self.correlation_id = correlation_id
        self._forget = forget
        self.completion: dict[str, Any] | None = None
        self._records = records
        self._deadline = deadline
        self._sent_at = sent_at
        self._attempt: bytes | None = None
        self._abandoned: set[bytes] = set()
        self._next = 0
        self._text = ""

    def __iter__(self) -> Iterator[Delta]:
        restart = False
        while self.completion is None:
            record = self._take()
            headers = {name: raw for name, raw in (record.headers() or []) if raw is not None}
            if EVENT not in headers:  # an error answered before any generation: no attempt, no sequence
                Reply.from_record(record, self._sent_at, time.monotonic()).result()
                raise StreamGap(f"a reply without {EVENT} for a streamed request ({self.correlation_id})")
            attempt, sequence = headers.get(ATTEMPT), int(headers.get(SEQUENCE, b"0"))
            if attempt in self._abandoned:
                continue
            if attempt != self._attempt:
                if self._attempt is not None:
                    self._abandoned.add(self._attempt)
                    restart = True
                self._attempt, self._next, self._text = attempt, 0, ""
            if sequence < self._next:
                continue  # a duplicate
            if sequence > self._next:
                raise StreamGap(f"chunk {self._next} of {self.correlation_id} is missing (got {sequence})")
            self._next += 1
            delta = self._read(record, headers)
            if delta is not None or restart:
                yield Delta(delta or "", restart)
                restart = False

    def _read(self, record: Any, headers: dict[str, bytes]) -> str | None:
        if headers[EVENT] == b"delta":
            text: str = orjson.loads(record.value())["choices"][0]["delta"].get("content", "")
            self._text += text
            return text
        completion = Reply.from_record(record, self._sent_at, time.monotonic()).result()
        whole = completion["choices"][0]["message"]["content"]
        if not whole.startswith(self._text):
            raise StreamGap(f"the final text of {self.correlation_id} does not continue its chunks")
        self.completion = completion
        # Without chunks (not streamed, or exactly-once), the final's text is the one delta.
        rest = whole[len(self._text):]
        return rest or None

    def _take(self) -> Any:
        left = self._deadline - time.monotonic()
        try:
            return self._records.get(timeout=max(0.0, left))
        except queue.Empty:
            self._forget()
            raise RequestTimeout(f"no final record within the timeout (correlation id {self.correlation_id})") from None
