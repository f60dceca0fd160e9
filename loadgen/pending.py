"""The client's table of requests awaiting replies: bounded, with deadlines, no Kafka in it.

Every request gets one entry from ``add`` to exactly one of ``take`` (its reply arrived),
``expire`` (its deadline passed), ``discard`` (it could not be sent) or ``close``. Whoever removes
the entry settles its future, outside the lock, so callbacks may call back into the client.
Finished correlation ids are remembered (a bounded FIFO) to tell a late reply (its request already
timed out) and a duplicate (its request was already answered) from a reply meant for another client
reading the same partition.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

from kinference.loadgen.errors import ClientClosed, TooManyPending

_ANSWERED = "answered"
_TIMED_OUT = "timed_out"


@dataclass(frozen=True, slots=True)
class ClientStats:
    """Counters since the client started. ``late`` and ``duplicates`` replies were dropped."""

    sent: int = 0
    answered: int = 0
    timed_out: int = 0
    failed: int = 0
    late: int = 0
    duplicates: int = 0
    unmatched: int = 0
    """Replies with a correlation id this client never sent (other clients on the same partition,
    or replies already on the partition when the client started)."""
    pending: int = 0


@dataclass(slots=True)
class Pending:
    correlation_id: str
    deadline: float
    sent_at: float
    future: Future[Any] = field(default_factory=Future)


class PendingTable:
    def __init__(self, max_pending: int, recent_capacity: int) -> None:
        if max_pending < 1 or recent_capacity < 1:
            raise ValueError("max_pending and recent_capacity must be at least 1")
        self.max_pending = max_pending
        self._recent_capacity = recent_capacity
        self._lock = threading.Lock()
        self._not_full = threading.Condition(self._lock)
        self._entries: dict[str, Pending] = {}
        self._deadlines: list[tuple[float, str]] = []
        self._recent: OrderedDict[str, str] = OrderedDict()
        self._counts = dict.fromkeys(("sent", "answered", "timed_out", "failed", "late", "duplicates",
                                      "unmatched"), 0)
        self._closed = False

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, correlation_id: str, deadline: float, block: bool = True) -> Pending:
        """Register a request about to be sent. When the table is full, wait for room until
        ``deadline`` (or not at all without ``block``), then raise ``TooManyPending``."""
        with self._not_full:
            while len(self._entries) >= self.max_pending and not self._closed:
                remaining = deadline - time.monotonic()
                if not block or remaining <= 0:
                    raise TooManyPending(f"{self.max_pending} requests are already awaiting replies")
                self._not_full.wait(remaining)
            if self._closed:
                raise ClientClosed("the client is closed")
            if correlation_id in self._entries:
                raise ValueError(f"correlation id {correlation_id!r} is already pending")
            entry = Pending(correlation_id, deadline, time.monotonic())
            self._entries[correlation_id] = entry
            heapq.heappush(self._deadlines, (deadline, correlation_id))
            self._counts["sent"] += 1
            return entry

    def take(self, correlation_id: str) -> Pending | None:
        """The entry a reply answers, or None (then the reply is counted as late, duplicate or
        unmatched, and must be dropped)."""
        with self._lock:
            entry = self._remove(correlation_id, _ANSWERED, "answered")
            if entry is None:
                earlier = self._recent.get(correlation_id)
                if earlier == _TIMED_OUT:
                    self._counts["late"] += 1
                    self._recent[correlation_id] = _ANSWERED  # a second late copy is a duplicate
                elif earlier == _ANSWERED:
                    self._counts["duplicates"] += 1
                else:
                    self._counts["unmatched"] += 1
            return entry

    def discard(self, correlation_id: str) -> Pending | None:
        """Remove a request that could not be sent."""
        with self._lock:
            return self._remove(correlation_id, _TIMED_OUT, "failed")

    def expire(self, now: float) -> list[Pending]:
        """Remove and return the requests whose deadline is at or before ``now``."""
        expired = []
        with self._lock:
            while self._deadlines and self._deadlines[0][0] <= now:
                _, correlation_id = heapq.heappop(self._deadlines)
                entry = self._remove(correlation_id, _TIMED_OUT, "timed_out")
                if entry is not None:
                    expired.append(entry)
        return expired

    def next_deadline(self) -> float | None:
        with self._lock:
            return self._deadlines[0][0] if self._deadlines else None

    def close(self) -> list[Pending]:
        """Refuse new requests; remove and return every pending one."""
        with self._not_full:
            self._closed = True
            entries = list(self._entries.values())
            self._entries.clear()
            self._deadlines.clear()
            self._not_full.notify_all()
            return entries

    def stats(self) -> ClientStats:
        with self._lock:
            return ClientStats(**self._counts, pending=len(self._entries))

    def _remove(self, correlation_id: str, outcome: str, counter: str) -> Pending | None:
        entry = self._entries.pop(correlation_id, None)
        if entry is None:
            return None
        self._counts[counter] += 1
        self._recent[correlation_id] = outcome
        if len(self._recent) > self._recent_capacity:
            self._recent.popitem(last=False)
        # Answered entries leave their deadline in the heap; rebuild it before it outgrows the table.
        if len(self._deadlines) > 2 * len(self._entries) + 64:
            self._deadlines = [(e.deadline, cid) for cid, e in self._entries.items()]
            heapq.heapify(self._deadlines)
        self._not_full.notify()
        return entry


def settle(future: Future[Any], result: Any = None, error: BaseException | None = None) -> None:
    """Complete ``future`` unless its caller already cancelled it."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass
