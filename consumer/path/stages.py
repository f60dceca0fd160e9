"""The stages: a pipeline of preprocess -> inference -> postprocess thread pools (``pools``) over micro-batches,
and its watchdog.

``Pipeline`` takes a batch from the batcher only when an inference slot is free (one slot per
inference thread, plus one for a full batch, preprocessed while inference runs), splits it into
micro-batches of ``micro_batch_size`` and sends them through
three thread pools joined by bounded queues, so pre/post of one micro-batch overlap inference of
another (TorchServe micro-batching). Each micro-batch carries its own requests, so results match
their requests whatever order micro-batches finish in. Every outcome, result or error, is set on
the request it belongs to (its reply value by ``results``); a failing handler call fails only the requests of that
micro-batch. The watchdog answers the requests of a handler call that runs over its timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kinference.consumer.config import Batching
from kinference.consumer.ledger.request import Request
from kinference.consumer.ops.logs import about
from kinference.consumer.ops.metrics import Metrics
from kinference.consumer.path.admission import let_go
from kinference.consumer.path.pools import POLL_S, Abandoned, BatchTicket, MicroBatch, PoolsShare, StagePool
from kinference.consumer.path.results import reply_value
from kinference.errors import RequestError
from kinference.handlers.base import Handler
from kinference.protocol import ErrorCode

if TYPE_CHECKING:
    from kinference.consumer.ops.tracing import Tracing

log = logging.getLogger(__name__)


class Batches(Protocol):
    """Where a pipeline takes its batches from: the model's batcher (``batcher.Batcher``)."""

    def next_batch(self, timeout_s: float, only_full: Callable[[], bool]) -> list[Request]:
        """Blocks until a batch is due; while ``only_full()`` is true it may return only a full batch."""

    def wake(self) -> None:
        """Look again: an inference thread freed up."""

    def observe(self, work: int, seconds: float) -> None:
        """Learn the cost of an inference call."""


class Inference(Protocol):
    """Where a pipeline's inference runs, chosen once where the model is built: in this process
    (``InProcessInference``), or in the device process (``worker_link.DeviceInference``)."""

    def prepare(self) -> None:
        """Once in each inference thread before it serves: the model warmed up, or its device process ready."""

    def infer(self, inputs: Any) -> Any:
        """One micro-batch's ``preprocess`` result in, its outputs out."""


class InProcessInference:
    """The handler's own ``inference``, in this process."""

    def __init__(self, handler: Handler) -> None:
        self._handler = handler
        self._warm_up_lock = threading.Lock()

    def prepare(self) -> None:
        # Each inference thread warms the model up itself: torch keeps a thread pool per calling thread, and a model
        # first run on another thread (measured: the one that called setup) runs 30-50% slower here. One thread at a
        # time: compiling the same model from several threads at once is not safe in torch.
        with self._warm_up_lock:
            self._handler.warm_up()

    def infer(self, inputs: Any) -> Any:
        return self._handler.inference(inputs)


@dataclass(frozen=True, slots=True)
class ModelRun:
    """What a pipeline runs: a served model's name (its metrics' label, and its errors'), its handler, how its
    batches run (``Batching``: micro-batch size, threads per stage, handler timeout), and where its inference runs
    (``inference``: ``InProcessInference(handler)``, or the device process's)."""

    name: str
    handler: Handler
    batching: Batching
    inference: Inference


class Pipeline:
    """Pulls batches from ``batches`` while inference has room; hands finished requests to ``emit``."""

    def __init__(
        self,
        run: ModelRun,
        batches: Batches,
        emit: Callable[[list[Request]], None],
        metrics: Metrics,
        tracing: Tracing | None = None,
    ) -> None:
        """``tracing``, when on, records a span per micro-batch and per stage call. A handler call may run for
        ``run.batching.handler_timeout_s`` at most (``_watch``)."""
        batching, model = run.batching, run.name
        self._handler = run.handler
        self._inference_port = run.inference
        self._model = model
        self._handler_timeout_s = batching.handler_timeout_s
        threads = batching.parallelism
        self.stuck: str | None = None
        """Why the model is unhealthy: a handler call ran over the timeout (for good: the orchestrator restarts
        the process, the only way to get the thread back)."""
        self._settle_lock = threading.Lock()
        self._in_progress = 0
        """Requests taken from the batcher and not yet handed on to be answered."""
        self._tracing = tracing
        self._batches = batches
        self._metrics = metrics
        self._batch_size = metrics.batch_size.labels(model)
        self._real_tokens = metrics.batch_real_tokens.labels(model)
        self._padded_tokens = metrics.batch_padded_tokens.labels(model)
        self._emit = emit
        self._micro = batching.micro_batch_size or batching.max_batch_size
        # One batch per inference thread, and one more when a full batch waits (a backlog): taken and preprocessed
        # while inference runs, it waits in the inference queue, so an inference thread that finishes starts the
        # next batch at once instead of idling through the hand-offs to the dispatcher and the preprocess thread
        # (each one a wait for the GIL). Only a full batch: a partial one keeps waiting in the batcher, where its
        # policy may still grow it and its requests' deadlines are still checked, until a thread is free.
        in_flight = threads.inference + 1
        self._inference_threads = threads.inference
        self._slots = threading.Semaphore(in_flight)
        self._running = 0
        """Batches taken whose inference has not finished."""
        self._running_lock = threading.Lock()
        parts_per_batch = -(-batching.max_batch_size // self._micro)
        self._stopping = threading.Event()
        self._abandon = threading.Event()
        # A slot admits one batch, so at most this many micro-batches wait in any one stage queue.
        shared = PoolsShare(model, metrics, in_flight * parts_per_batch + threads.postprocess, self._abandon)
        # Chosen once here, so that untraced stages do not even ask whether to trace.
        traced = tracing.stage if tracing is not None else _untraced
        self._post = StagePool("postprocess", traced("postprocess", self._postprocess), self._emit_micro_batch,
                               threads.postprocess, shared)
        self._infer = StagePool("inference", traced("inference", self._inference), self._to_postprocess,
                                threads.inference, shared, prepare=self._inference_port.prepare)
        self._pre = StagePool("preprocess", traced("preprocess", self._preprocess), self._infer.put,
                              threads.preprocess, shared)
        self._pools = (self._pre, self._infer, self._post)
        self._dispatcher = threading.Thread(target=self._dispatch, name="kinference-dispatch", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name=f"kinference-watchdog-{model}", daemon=True)

    def start(self) -> None:
        """Start the stage threads, once every inference thread has warmed the model up (its error, if
        one failed to); then take batches."""
        started = []
        try:
            for pool in self._pools:
                pool.start()
                started.append(pool)
        except BaseException:
            for pool in started:
                pool.stop(time.monotonic() + 5.0)
            raise
        self._dispatcher.start()
        self._watchdog.start()

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Stop taking batches; finish those already taken within ``timeout_s``. False when a stage thread is
        still busy then (a handler call that does not return): it is left running, and its work unanswered."""
        self._stopping.set()
        deadline = time.monotonic() + timeout_s
        self._dispatcher.join(timeout_s)
        stopped = [pool.stop(deadline) for pool in self._pools]
        if all(stopped) and not self._dispatcher.is_alive():
            return True
        self._abandon.set()
        return False

    @property
    def healthy(self) -> bool:
        return self.stuck is None and self._dispatcher.is_alive() and all(pool.alive for pool in self._pools)

    @property
    def in_progress(self) -> int:
        """Requests taken from the batcher and not yet handed on to be answered."""
        return self._in_progress

    def _watch(self) -> None:
        """Answer the requests of a handler call that runs longer than ``handler_timeout_s`` with
        ``handler_timeout`` (and a dead letter), at once, without waiting for the call, and mark the model
        unhealthy. The call goes on in its thread (Python cannot stop it); if it ever returns, its micro-batch
        passes the remaining stages empty and is not answered again (``_settle``)."""
        limit = self._handler_timeout_s
        while not self._stopping.wait(min(1.0, limit / 4)):
            now = time.monotonic()
            for pool in self._pools:
                for started, micro_batch in pool.started_before(now - limit):
                    self._time_out(pool.name, micro_batch, now - started)

    def _time_out(self, stage: str, micro_batch: MicroBatch, running_s: float) -> None:
        error = RequestError(f"{stage} of model {self._model!r} ran {running_s:.1f} s, over handler_timeout_s "
                             f"({self._handler_timeout_s:g} s)", ErrorCode.HANDLER_TIMEOUT)
        if not self._settle(micro_batch, error):
            return  # it finished meanwhile
        self.stuck = self.stuck or error.message
        log.error("%s; %d requests answered with handler_timeout; the model is unhealthy", error.message,
                  len(micro_batch.requests), extra=about(micro_batch.requests[0]))
        self._hand_on(micro_batch)

    def _settle(self, micro_batch: MicroBatch, error: RequestError | None = None) -> bool:
        """Claim ``micro_batch`` for answering: True once, for whichever comes first, the last stage or the
        timeout. With ``error``, its requests still ok fail with it and are dead-lettered."""
        with self._settle_lock:
            if micro_batch.settled:
                return False
            micro_batch.settled = True
            if error is not None:
                for request in micro_batch.active:
                    request.dead_letter = True
                micro_batch.fail_active(error)
            return True

    def _hand_on(self, micro_batch: MicroBatch) -> None:
        if micro_batch.trace is not None:
            micro_batch.trace.span.end()
        with self._settle_lock:
            self._in_progress -= len(micro_batch.requests)
        let_go(micro_batch.requests)
        self._emit(micro_batch.requests)

    def _dispatch(self) -> None:
        while not self._stopping.is_set():
            if not self._slots.acquire(timeout=POLL_S):
                continue
            try:
                batch = self._batches.next_batch(POLL_S, self._prefetching)
            except Exception:
                log.exception("batcher failed; retrying")
                batch = []
            if not batch:
                self._slots.release()
                continue
            self._batch_size.observe(len(batch))
            with self._settle_lock:
                self._in_progress += len(batch)
            parts = [batch[i : i + self._micro] for i in range(0, len(batch), self._micro)]
            with self._running_lock:
                self._running += 1
            ticket = BatchTicket(len(parts), self._inference_done)
            try:
                for part in parts:
                    trace = self._tracing.batch(part) if self._tracing is not None else None
                    self._pre.put(MicroBatch(part, ticket, active=[request for request in part if request.ok],
                                             trace=trace))
            except Abandoned:
                return

    def _prefetching(self) -> bool:
        """Every inference thread has a batch: the next one would wait in the inference queue."""
        return self._running >= self._inference_threads

    def _inference_done(self) -> None:
        with self._running_lock:
            self._running -= 1
        self._slots.release()
        self._batches.wake()

    def _preprocess(self, micro_batch: MicroBatch) -> None:
        micro_batch.items = [request.item for request in micro_batch.active]
        micro_batch.inputs = self._handler.preprocess(micro_batch.items)
        tokens = self._handler.token_counts(micro_batch.inputs)
        if tokens is None:
            micro_batch.work = len(micro_batch.items)
        else:
            self._real_tokens.inc(tokens[0])
            self._padded_tokens.observe(tokens[1])
            micro_batch.work = tokens[1]

    def _inference(self, micro_batch: MicroBatch) -> None:
        started = time.perf_counter()
        micro_batch.outputs = self._inference_port.infer(micro_batch.inputs)
        elapsed = time.perf_counter() - started
        for request in micro_batch.active:
            request.inference_ms = elapsed * 1000
        micro_batch.inputs = None
        self._batches.observe(micro_batch.work, elapsed)

    def _to_postprocess(self, micro_batch: MicroBatch) -> None:
        self._post.put(micro_batch)
        micro_batch.ticket.part_done()

    def _postprocess(self, micro_batch: MicroBatch) -> None:
        results = self._handler.postprocess(micro_batch.outputs, micro_batch.items)
        micro_batch.outputs = None
        if not isinstance(results, list) or len(results) != len(micro_batch.active):
            count = len(results) if isinstance(results, list) else type(results).__name__
            raise RequestError(f"postprocess returned {count} results for {len(micro_batch.active)} requests")
        for request, result in zip(micro_batch.active, results, strict=True):
            try:
                request.reply_value = reply_value(request, result)
            except RequestError as exc:  # this result alone: e.g. an OIP request asked for an output it lacks
                request.fail(exc)

    def _emit_micro_batch(self, micro_batch: MicroBatch) -> None:
        if self._settle(micro_batch):
            self._hand_on(micro_batch)


def _untraced(_name: str, work: Callable[[MicroBatch], None]) -> Callable[[MicroBatch], None]:
    return work
