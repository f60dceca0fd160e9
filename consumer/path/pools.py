"""The stage pools: the thread pools a pipeline (``stages.Pipeline``) runs its micro-batches through, joined by
bounded queues, and the micro-batch they hand on.

Each pool's threads take a micro-batch from its inbox, run their stage's work on it and hand it to the next pool. A
failing handler call fails only the requests of that micro-batch; a pool thread that dies says so (``crashed``), and
the calls running in each thread are there for the pipeline's watchdog to read (``started_before``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kinference.consumer.ledger.request import Request
from kinference.consumer.ops.logs import about
from kinference.consumer.ops.metrics import Metrics
from kinference.errors import RequestError, ServiceFault
from kinference.protocol import ErrorCode

if TYPE_CHECKING:
    from kinference.consumer.ops.tracing import BatchTrace

log = logging.getLogger(__name__)

_STOP = object()
POLL_S = 0.1
"""How long a stage waits on a full inbox (or a pipeline on a free slot) before it looks again whether to stop."""


class Abandoned(Exception):
    """The shutdown deadline passed while a stage waited to hand work on: the work is left unanswered (its
    offsets stay uncommitted and it is served again after a restart)."""


class BatchTicket:
    """Holds an inference slot until every micro-batch of its batch has left inference."""

    def __init__(self, parts: int, release: Callable[[], None]) -> None:
        self._parts = parts
        self._release = release
        self._lock = threading.Lock()

    def part_done(self) -> None:
        with self._lock:
            self._parts -= 1
            last = self._parts == 0
        if last:
            self._release()


@dataclass(slots=True, eq=False)
class MicroBatch:
    requests: list[Request]
    ticket: BatchTicket
    active: list[Request] = field(default_factory=list)
    """The requests still ok: the handler sees only these, in this order."""
    items: list[Any] = field(default_factory=list)
    inputs: Any = None
    work: int = 0
    """Padded tokens of ``inputs`` (for handlers that count tokens), else the item count."""
    outputs: Any = None
    trace: BatchTrace | None = None
    """The micro-batch's span (``consumer.tracing``); None when tracing is off."""
    settled: bool = False
    """Its requests were handed on to be answered (``Pipeline._settle``): once, by the last stage or by the
    handler timeout, whichever comes first."""

    def fail_active(self, error: RequestError) -> None:
        for request in self.active:
            request.fail(error)
        self.active = []


@dataclass(frozen=True, slots=True)
class PoolsShare:
    """What the three stage pools of one pipeline have in common."""

    model: str
    """The model whose stages these are: the metrics' label."""
    metrics: Metrics
    inbox_size: int
    abandon: threading.Event
    """Set when the shutdown deadline passed: a full inbox then stops waiting."""


class StagePool:
    """``threads`` workers running ``work`` on each micro-batch from ``inbox``, then ``forward``.

    ``prepare``, when given, runs first in each worker thread; ``start`` returns once every worker has
    run it, and raises its error if one failed.
    """

    def __init__(
        self,
        name: str,
        work: Callable[[MicroBatch], None],
        forward: Callable[[MicroBatch], None],
        threads: int,
        shared: PoolsShare,
        prepare: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self._abandon = shared.abandon
        self._seconds = shared.metrics.stage_seconds.labels(shared.model, name)
        self.inbox: queue.Queue[Any] = queue.Queue(maxsize=shared.inbox_size)
        self._work = work
        self._forward = forward
        self._threads = [
            threading.Thread(target=self._run, args=(i,), name=f"kinference-{name}-{i}", daemon=True)
            for i in range(threads)
        ]
        self._calls: list[tuple[float, MicroBatch] | None] = [None] * threads
        """Per thread, the handler call it is in: (``time.monotonic()`` at its start, its micro-batch). Each thread
        writes only its own slot."""
        self.crashed: list[str] = []
        self._prepare = prepare
        self._prepared = threading.Semaphore(0)
        self._prepare_errors: list[BaseException] = []

    def start(self) -> None:
        for thread in self._threads:
            thread.start()
        for _ in self._threads:
            self._prepared.acquire()
        if self._prepare_errors:
            raise self._prepare_errors[0]

    def put(self, micro_batch: MicroBatch) -> None:
        """Hand a micro-batch to this pool; waits while its inbox is full, but not past the shutdown deadline."""
        while True:
            try:
                self.inbox.put(micro_batch, timeout=POLL_S)
                return
            except queue.Full:
                if self._abandon.is_set():
                    raise Abandoned(f"{self.name} did not take a micro-batch before the shutdown deadline") from None

    def stop(self, deadline: float) -> bool:
        """Let queued work finish, then end the threads (one sentinel each, behind the work), by ``deadline``
        (``time.monotonic()``). False when a thread is still busy then."""
        for _ in self._threads:
            try:
                self.inbox.put(_STOP, timeout=max(0.0, deadline - time.monotonic()))
            except queue.Full:
                break
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads)

    @property
    def alive(self) -> bool:
        return all(thread.is_alive() for thread in self._threads)

    def started_before(self, moment: float) -> list[tuple[float, MicroBatch]]:
        """The handler calls running now that started before ``moment``: (start, micro-batch)."""
        return [call for call in list(self._calls) if call is not None and call[0] < moment]

    def _run(self, index: int) -> None:
        try:
            if self._prepare is not None:
                self._prepare()
        except BaseException as exc:
            self._prepare_errors.append(exc)
            return
        finally:
            self._prepared.release()
        try:
            while (micro_batch := self.inbox.get()) is not _STOP:
                self._process(micro_batch, index)
        except Abandoned:
            return
        except BaseException as exc:  # a stage thread must never die silently
            self.crashed.append(f"{threading.current_thread().name}: {exc!r}")
            log.critical("stage thread %s died", threading.current_thread().name, exc_info=True)
            raise

    def _process(self, micro_batch: MicroBatch, index: int) -> None:
        try:
            if micro_batch.active:
                started = time.perf_counter()
                self._calls[index] = (time.monotonic(), micro_batch)
                try:
                    self._work(micro_batch)
                finally:
                    self._calls[index] = None
                self._seconds.observe(time.perf_counter() - started)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            # Whatever the handler raises fails this micro-batch alone: SystemExit too (library code calls
            # sys.exit; letting it end the thread left the micro-batch unanswered and, after each restart, crashed
            # the service again on the same records), and GeneratorExit, which means something only inside a
            # generator being closed, and this is none. Only KeyboardInterrupt is the operator's.
            log.warning("%s failed for a micro-batch of %d requests: %r", self.name, len(micro_batch.active), exc,
                        exc_info=log.isEnabledFor(logging.DEBUG), extra=about(micro_batch.requests[0]))
            code = exc.code if isinstance(exc, ServiceFault) else ErrorCode.HANDLER_ERROR
            micro_batch.fail_active(RequestError(f"{self.name} failed: {exc!r}", code))
        try:
            self._forward(micro_batch)
        except Abandoned:
            raise
        except Exception:  # the publisher is down: these requests stay unanswered, and the service is unhealthy
            log.critical("%s could not hand on a micro-batch of %d requests", self.name, len(micro_batch.requests),
                         exc_info=True, extra=about(micro_batch.requests[0]))
