"""The batcher: the waiting room between the source and the stages.

Requests wait here until the policy says a batch is due. The stage pipeline asks for a batch only
when inference has room (see ``stages.Pipeline``), so "due" means:

- ``greedy``: at once, with everything waiting (up to ``max_batch_size``). Nothing is held while
  inference has room; under load, requests pile up while the model is busy and batches grow by
  themselves. A lone request is never delayed.
- ``static``: TorchServe's semantics: when ``max_batch_size`` requests wait, or when the oldest has
  waited ``max_batch_delay_ms`` since it arrived (arrival = when the poll thread received it).

Requests whose deadline has passed are rejected here with ``deadline_exceeded``, never computed.
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
        self._reject = reject
        self._clock = clock
        self._epoch_ms = epoch_ms
        self._waiting: deque[Request] = deque()
        self._cond = threading.Condition()
        self._closed = False

    def put(self, request: Request) -> None:
        if self._fail_if_expired(request):
            return
        with self._cond:
            self._waiting.append(request)
            self._cond.notify()

    def wait_s(self, now: float) -> float | None:
        """Seconds until a batch is due (0: due now); None while nothing waits."""
        if not self._waiting:
            return None
        if self.policy == "greedy" or len(self._waiting) >= self.max_batch_size:
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
                taken = [self._waiting.popleft() for _ in range(min(self.max_batch_size, len(self._waiting)))]
            batch = [request for request in taken if not self._fail_if_expired(request)]
            if batch:
                for request in batch:
                    request.dispatched = now
                    request.batch_size = len(batch)
                return batch

    def discard(self, partitions: Iterable[tuple[str, int]]) -> list[Request]:
        """Remove and return the waiting requests of these partitions (they are being revoked)."""
        keys = set(partitions)
        with self._cond:
            kept, dropped = deque(), []
            for request in self._waiting:
                (dropped if (request.topic, request.partition) in keys else kept).append(request)
            self._waiting = kept
            return dropped

    def close(self) -> None:
        """Wake every waiter; ``next_batch`` returns empty from now on."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _fail_if_expired(self, request: Request) -> bool:
        if request.expired(self._epoch_ms()):
            request.fail(RequestError("deadline passed before the request was computed",
                                      ErrorCode.DEADLINE_EXCEEDED))
            self._reject(request)
            return True
        return False
