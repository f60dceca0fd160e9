"""The batcher: the waiting room between the source and the stages.

Requests wait here until the policy says a batch is due. The stage pipeline asks for a batch only
when inference has room (see ``stages.Pipeline``), so "due" means:

- ``greedy``: at once, with everything waiting (up to ``max_batch_size``). Nothing is held while
  inference has room; under load, requests pile up while the model is busy and batches grow by
  themselves. A lone request is never delayed.
- ``static``: TorchServe's semantics: when ``max_batch_size`` requests wait, or when the oldest has
  waited ``max_batch_delay_ms`` since it arrived (arrival = when the poll thread received it).

A batch also stops growing at ``max_batch_bytes`` of request values (it always takes at least one).

Requests are rejected here, never computed, when their deadline has passed (``deadline_exceeded``) or
when they have waited longer than ``max_queue_ms`` (``overloaded``: under overload the oldest work is
shed instead of latency growing without bound).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Literal

from consumer.errors import ErrorCode, RequestError
from consumer.protocol import Request

BatchPolicy = Literal["greedy", "static"]


class Batcher:
    def __init__(
        self,
        policy: BatchPolicy,
        max_batch_size: int,
        max_batch_delay_ms: float,
        reject: Callable[[Request], None],
        *,
        max_batch_bytes: int | None = None,
        max_queue_ms: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        epoch_ms: Callable[[], float] = lambda: time.time() * 1000,
    ) -> None:
        if policy not in ("greedy", "static"):
            raise ValueError(f"unknown batch policy {policy!r}")
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        self.policy = policy
        self.max_batch_size = max_batch_size
        self.max_batch_delay_s = max_batch_delay_ms / 1000
        self.max_batch_bytes = max_batch_bytes
        self.max_queue_ms = max_queue_ms
        self._reject = reject
        self._clock = clock
        self._epoch_ms = epoch_ms
        self._waiting: deque[Request] = deque()
        self._waiting_bytes = 0
        self._cond = threading.Condition()
        self._closed = False

    def put(self, request: Request) -> None:
        error = self._rejection(request, self._clock())
        if error is not None:
            self._refuse(request, error)
            return
        with self._cond:
            self._waiting.append(request)
            self._waiting_bytes += _size(request)
            self._cond.notify()

    def wait_s(self, now: float) -> float | None:
        """Seconds until a batch is due (0: due now); None while nothing waits."""
        if not self._waiting:
            return None
        if self.policy == "greedy" or len(self._waiting) >= self.max_batch_size or (
            self.max_batch_bytes is not None and self._waiting_bytes >= self.max_batch_bytes
        ):
            return 0.0
        return max(0.0, self._waiting[0].received + self.max_batch_delay_s - now)

    def next_batch(self, timeout_s: float) -> list[Request]:
        """Block until a batch is due and return it; an empty list on timeout or close."""
        deadline = self._clock() + timeout_s
        while True:
            with self._cond:
                now = self._clock()
                wait = self.wait_s(now)
                while wait != 0.0 and not self._closed:
                    remaining = deadline - now
                    if remaining <= 0:
                        return []
                    self._cond.wait(remaining if wait is None else min(wait, remaining))
                    now = self._clock()
                    wait = self.wait_s(now)
                if self._closed:
                    return []
                batch, rejected = self._take(now)
            for request, error in rejected:
                self._refuse(request, error)
            if batch:
                for request in batch:
                    request.dispatched = now
                    request.batch_size = len(batch)
                return batch

    def _take(self, now: float) -> tuple[list[Request], list[tuple[Request, RequestError]]]:
        """The oldest servable requests within the size and byte limits (at least one), and the
        expired or shed ones met on the way: those do not count against the batch size."""
        taken: list[Request] = []
        rejected: list[tuple[Request, RequestError]] = []
        size = 0
        while self._waiting and len(taken) < self.max_batch_size:
            nbytes = _size(self._waiting[0])
            if taken and self.max_batch_bytes is not None and size + nbytes > self.max_batch_bytes:
                break
            request = self._waiting.popleft()
            self._waiting_bytes -= nbytes
            error = self._rejection(request, now)
            if error is None:
                taken.append(request)
                size += nbytes
            else:
                rejected.append((request, error))
        return taken, rejected

    def discard(self, partitions: Iterable[tuple[str, int]]) -> list[Request]:
        """Remove and return the waiting requests of these partitions (they are being revoked)."""
        keys = set(partitions)
        with self._cond:
            kept, dropped = deque(), []
            for request in self._waiting:
                (dropped if (request.topic, request.partition) in keys else kept).append(request)
            self._waiting = kept
            self._waiting_bytes = sum(_size(request) for request in kept)
            return dropped

    def close(self) -> None:
        """Wake every waiter; ``next_batch`` returns empty from now on."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _refuse(self, request: Request, error: RequestError) -> None:
        request.fail(error)
        self._reject(request)

    def _rejection(self, request: Request, now: float) -> RequestError | None:
        """Why a request must not be computed: past its deadline, or waited too long."""
        now_ms = self._epoch_ms()
        if request.expired(now_ms):
            return RequestError("deadline passed before the request was computed", ErrorCode.DEADLINE_EXCEEDED)
        if self.max_queue_ms is not None and (age := request.age_ms(now, now_ms)) > self.max_queue_ms:
            return RequestError(f"shed after waiting {age:.0f} ms; max_queue_ms is {self.max_queue_ms:g}",
                                ErrorCode.OVERLOADED)
        return None


def _size(request: Request) -> int:
    return len(request.value) if request.value is not None else 0
