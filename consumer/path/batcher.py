"""The batcher: the waiting room between admission and the stages.

Requests wait here until the policy says a batch is due. The stage pipeline asks for a batch only
when inference has room (see ``stages.Pipeline``), so "due" means:

- ``greedy``: at once, with everything waiting (up to the limits below). Nothing is held while
  inference has room; under load, requests pile up while the model is busy and batches grow by
  themselves. A lone request is never delayed.
- ``adaptive``: like greedy, except that it holds a batch open while waiting is expected to raise
  throughput (fewer requests wait than arrive during one batch's fixed cost, as learned by
  ``cost.BatchCost``), and only as long as the oldest request can still be answered within
  ``target_latency_ms`` and for at most ``max_batch_delay_ms``. See consumer/path/cost.py for the rule.
- ``static``: TorchServe's semantics: when ``max_batch_size`` requests wait, or when the oldest has
  waited ``max_batch_delay_ms`` since it arrived (arrival = when the poll thread received it).

A batch holds at most ``max_batch_size`` requests and ``max_batch_bytes`` of request values. With a
token budget (``max_batch_tokens``) and a handler that counts tokens, it also holds at most that many
padded tokens (longest x count), and its requests are chosen by length: the oldest waiting request
always goes (so no request, long or short, is starved: each batch serves the oldest), joined by the
waiting requests nearest to it in length, as long as the longest stays within ``GROUP_SPREAD`` times
the shortest plus ``GROUP_SLACK_TOKENS``. A request over the budget runs alone. Without a token
budget, batches are first-in-first-out.

Requests are rejected here, never computed, when their deadline has passed (``deadline_exceeded``) or
when they have waited longer than ``max_queue_ms`` (``overloaded``: under overload the oldest work is
shed instead of latency growing without bound).
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kinference.consumer.config import Batching
from kinference.consumer.ledger.request import Request
from kinference.consumer.path.admission import let_go
from kinference.consumer.path.cost import ArrivalRate, BatchCost
from kinference.errors import RequestError
from kinference.protocol import ErrorCode

GROUP_SPREAD = 2.0
"""A length-grouped batch's longest request is at most this many times its shortest (plus the slack):
padding then costs at most half of a batch, and in practice far less."""
GROUP_SLACK_TOKENS = 16
"""Very short requests group freely: a few padding tokens cost less than running another batch."""


@dataclass(slots=True, eq=False)
class _Waiting:
    request: Request
    seq: int
    tokens: int
    taken: bool = False

    @property
    def key(self) -> tuple[int, int]:
        """Where it sits in the length order."""
        return self.tokens, self.seq


Rejected = list[tuple[Request, RequestError]]


class Batcher:
    def __init__(
        self,
        batching: Batching,
        reject: Callable[[list[Request]], None],
        *,
        max_queue_ms: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        epoch_ms: Callable[[], float] = lambda: time.time() * 1000,
    ) -> None:
        """``batching``: the policy and limits (validated there); ``reject``: gets the requests refused here, each
        failed with its error, to be answered (``Publisher.submit`` in the service); ``max_queue_ms``: shed requests
        older than this (None: never)."""
        self.batching = batching
        self.max_batch_delay_s = batching.max_batch_delay_ms / 1000
        self.target_latency_s = batching.target_latency_ms / 1000
        self.max_queue_ms = max_queue_ms
        self.cost = BatchCost()
        self.arrivals = ArrivalRate()
        self._reject = reject
        self._clock = clock
        self._epoch_ms = epoch_ms
        self._seq = itertools.count()
        self._fifo: deque[_Waiting] = deque()
        """Every waiting request in arrival order; entries taken out of order stay until they reach the front."""
        self._by_length: list[tuple[int, int]] = []
        """(tokens, seq) of the waiting requests that have a token count, sorted: the length groups."""
        self._entries: dict[int, _Waiting] = {}
        self._waiting_bytes = 0
        self._waiting_tokens = self._counted = 0
        self._cond = threading.Condition()
        self._closed = False

    def put(self, requests: list[Request]) -> None:
        """Let a fetch's ``requests`` wait for their batches: one call, one lock and one wake of a waiting
        ``next_batch`` for all of them (a backlog's fetch put one at a time woke the dispatcher to look at each: a
        lock and a GIL hand-off per request). Those past their deadline, or shed, are answered at once. Takes all of
        them or, raising, none."""
        now, now_ms = self._clock(), self._epoch_ms()
        kept, refused = [], []
        for request in requests:
            error = self._rejection(request, now, now_ms)
            if error is None:
                kept.append(request)
            else:
                request.fail(error)
                refused.append(request)
        if refused:
            let_go(refused)
            self._reject(refused)
        if not kept:
            return
        entries = [_Waiting(request, seq, -1 if request.tokens is None else request.tokens)
                   for request, seq in zip(kept, self._seq, strict=False)]
        with self._cond:
            self.arrivals.add(now, len(entries))
            self._fifo.extend(entries)
            for entry in entries:
                self._entries[entry.seq] = entry
                if self._grouped(entry):
                    bisect.insort(self._by_length, entry.key)
                self._count(entry, 1)
            self._cond.notify_all()

    def observe(self, work: float, seconds: float) -> None:
        """A batch of ``work`` (padded tokens, or requests) took ``seconds`` of inference: learn from it."""
        with self._cond:
            self.cost.observe(work, seconds)

    @property
    def waiting(self) -> int:
        return len(self._entries)

    def wait_s(self, now: float) -> float | None:
        """Seconds until a batch is due (0: due now); None while nothing waits."""
        if not self._entries:
            return None
        count = len(self._entries)
        if self.batching.batch_policy == "greedy" or self._full():
            return 0.0
        oldest = self._oldest().request
        if self.batching.batch_policy == "static":
            return max(0.0, oldest.received + self.max_batch_delay_s - now)
        return self._adaptive_hold_s(oldest, count, now)

    def _due(self, now: float, only_full: Callable[[], bool]) -> float | None:
        wait = self.wait_s(now)
        if wait == 0.0 and not self._full() and only_full():
            return None  # until wake(), or more requests arrive
        return wait

    def _full(self) -> bool:
        return len(self._entries) >= self.batching.max_batch_size or (
            self.batching.max_batch_bytes is not None and self._waiting_bytes >= self.batching.max_batch_bytes)

    def wake(self) -> None:
        """An inference thread is free: a waiting ``next_batch`` looks again."""
        with self._cond:
            self._cond.notify_all()

    def _adaptive_hold_s(self, oldest: Request, count: int, now: float) -> float:
        fitted = self.cost.fit()
        rate = self.arrivals.per_s(now)
        if fitted is None or rate <= 0:
            return 0.0  # nothing learned yet: behave like greedy
        fixed_s, per_unit_s = fitted
        worth_waiting_for = min(rate * fixed_s, self.batching.max_batch_size)
        if count >= worth_waiting_for:
            return 0.0
        unit = self._mean_work_per_request()
        run_s = fixed_s + per_unit_s * unit * worth_waiting_for
        latest = min(oldest.received + self.target_latency_s - run_s, oldest.received + self.max_batch_delay_s)
        filled = now + (worth_waiting_for - count) / rate
        return max(0.0, min(filled, latest) - now)

    def _mean_work_per_request(self) -> float:
        """What one request adds to a batch's work: its tokens when the handler counts them, else 1."""
        return self._waiting_tokens / self._counted if self._counted else 1.0

    def next_batch(self, timeout_s: float, only_full: Callable[[], bool] = lambda: False) -> list[Request]:
        """Block until a batch is due and return it; an empty list on timeout or close. While ``only_full()`` is
        true, only a full batch is due (the caller would only queue it behind running ones); ``wake`` makes a
        waiting call ask again."""
        deadline = self._clock() + timeout_s
        while True:
            with self._cond:
                now = self._clock()
                wait = self._due(now, only_full)
                while wait != 0.0 and not self._closed:
                    remaining = deadline - now
                    if remaining <= 0:
                        return []
                    self._cond.wait(remaining if wait is None else min(wait, remaining))
                    now = self._clock()
                    wait = self._due(now, only_full)
                if self._closed:
                    return []
                batch, rejected = self._take(now)
            for request, error in rejected:
                request.fail(error)
            if rejected:
                refused = [request for request, _ in rejected]
                let_go(refused)
                self._reject(refused)
            if batch:
                for request in batch:
                    request.dispatched = now
                    request.batch_size = len(batch)
                return batch

    def _take(self, now: float) -> tuple[list[Request], Rejected]:
        """The next batch (at least one request) and the expired or shed requests met on the way:
        those do not count against the batch's limits."""
        rejected: Rejected = []
        now_ms = self._epoch_ms()
        while self._fifo:
            oldest = self._oldest()
            error = self._rejection(oldest.request, now, now_ms)
            if error is None:
                break
            self._remove([oldest])
            rejected.append((oldest.request, error))
        if not self._entries:
            return [], rejected
        oldest = self._oldest()
        if self._grouped(oldest):
            taken = self._take_length_group(oldest, (now, now_ms), rejected)
        else:
            taken = self._take_in_order((now, now_ms), rejected)
        return [entry.request for entry in taken], rejected

    def _take_in_order(self, now: tuple[float, float], rejected: Rejected) -> list[_Waiting]:
        taken: list[_Waiting] = []
        refused: list[_Waiting] = []
        size = 0
        for entry in self._fifo:
            if len(taken) == self.batching.max_batch_size:
                break
            if entry.taken:
                continue
            nbytes = _size(entry.request)
            if taken and self.batching.max_batch_bytes is not None and size + nbytes > self.batching.max_batch_bytes:
                break
            error = self._rejection(entry.request, *now)
            if error is None:
                taken.append(entry)
                size += nbytes
            else:
                refused.append(entry)
                rejected.append((entry.request, error))
        self._remove(taken + refused)
        return taken

    def _take_length_group(self, oldest: _Waiting, now: tuple[float, float], rejected: Rejected) -> list[_Waiting]:
        """The oldest request and the waiting ones nearest to it in length, within the limits (``now``: monotonic
        and epoch ms)."""
        assert self.batching.max_batch_tokens is not None
        by_length, anchor = self._by_length, oldest.tokens
        below = bisect.bisect_left(by_length, oldest.key) - 1
        above = below + 2
        taken, refused = [oldest], []
        shortest = longest = anchor
        size = _size(oldest.request)
        while len(taken) < self.batching.max_batch_size and (below >= 0 or above < len(by_length)):
            go_below = above >= len(by_length) or (
                below >= 0 and anchor - by_length[below][0] <= by_length[above][0] - anchor
            )
            entry = self._entries[by_length[below if go_below else above][1]]
            low, high = min(shortest, entry.tokens), max(longest, entry.tokens)
            nbytes = _size(entry.request)
            fits = (
                high * (len(taken) + 1) <= self.batching.max_batch_tokens
                and high <= GROUP_SPREAD * low + GROUP_SLACK_TOKENS
                and (self.batching.max_batch_bytes is None or size + nbytes <= self.batching.max_batch_bytes)
            )
            if not fits:  # the next one out on this side would fit even less
                if go_below:
                    below = -1
                else:
                    above = len(by_length)
                continue
            if go_below:
                below -= 1
            else:
                above += 1
            error = self._rejection(entry.request, *now)
            if error is not None:
                refused.append(entry)
                rejected.append((entry.request, error))
                continue
            taken.append(entry)
            shortest, longest, size = low, high, size + nbytes
        self._remove(taken + refused)
        return taken

    def _count(self, entry: _Waiting, sign: int) -> None:
        self._waiting_bytes += sign * _size(entry.request)
        if entry.tokens >= 0:
            self._waiting_tokens += sign * entry.tokens
            self._counted += sign

    def _grouped(self, entry: _Waiting) -> bool:
        return self.batching.max_batch_tokens is not None and entry.tokens >= 0

    def _oldest(self) -> _Waiting:
        while self._fifo[0].taken:
            self._fifo.popleft()
        return self._fifo[0]

    def _remove(self, entries: Iterable[_Waiting]) -> None:
        for entry in entries:
            entry.taken = True
            del self._entries[entry.seq]
            self._count(entry, -1)
            if self._grouped(entry):
                del self._by_length[bisect.bisect_left(self._by_length, entry.key)]
        while self._fifo and self._fifo[0].taken:
            self._fifo.popleft()

    def discard(self, partitions: Iterable[tuple[str, int]]) -> list[Request]:
        """Remove and return the waiting requests of these partitions (they are being revoked)."""
        keys = set(partitions)
        with self._cond:
            dropped = [entry for entry in self._entries.values()
                       if (entry.request.topic, entry.request.partition) in keys]
            self._remove(dropped)
            return [entry.request for entry in dropped]

    def close(self) -> None:
        """Wake every waiter; ``next_batch`` returns empty from now on."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _rejection(self, request: Request, now: float, now_ms: float) -> RequestError | None:
        """Why a request must not be computed: past its deadline, or waited too long."""
        if request.expired(now_ms):
            return RequestError("deadline passed before the request was computed", ErrorCode.DEADLINE_EXCEEDED)
        if self.max_queue_ms is not None and (age := request.age_ms(now, now_ms)) > self.max_queue_ms:
            return RequestError(f"shed after waiting {age:.0f} ms; max_queue_ms is {self.max_queue_ms:g}",
                                ErrorCode.OVERLOADED)
        return None


def _size(request: Request) -> int:
    return len(request.value) if request.value is not None else 0
