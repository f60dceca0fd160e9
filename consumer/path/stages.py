"""The stages: preprocess -> inference -> postprocess thread pools over micro-batches.

``Pipeline`` takes a batch from the batcher only when an inference slot is free (one slot per
inference thread, plus one for a full batch, preprocessed while inference runs), splits it into
micro-batches of ``micro_batch_size`` and sends them through
three thread pools joined by bounded queues, so pre/post of one micro-batch overlap inference of
another (TorchServe micro-batching). Each micro-batch carries its own requests, so results match
their requests whatever order micro-batches finish in. Every outcome, result or error, is set on
the request it belongs to; a failing handler call fails only the requests of that micro-batch.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from kinference.consumer.config import Batching
from kinference.consumer.ledger.request import Request
from kinference.consumer.ops.logs import about
from kinference.consumer.ops.metrics import Metrics
from kinference.errors import RequestError, ServiceFault
from kinference.handlers.base import Handler
from kinference.protocol import ErrorCode, encode_result

if TYPE_CHECKING:
    from kinference.consumer.ops.tracing import BatchTrace, Tracing

log = logging.getLogger(__name__)

_STOP = object()
_POLL_S = 0.1


class Abandoned(Exception):
    """The shutdown deadline passed while a stage waited to hand work on: the work is left unanswered (its
    offsets stay uncommitted and it is served again after a restart)."""


MAX_RESULT_DEPTH = 254
"""The deepest nesting of lists and dicts in a result: orjson writes no deeper, so a deeper result could not be
answered anyway; ``finite`` stops there instead of walking (or, recursing, overflowing) further."""


def finite(value: Any) -> bool:
    """No NaN or infinity anywhere in a result (floats, numpy arrays, nested lists and dicts). ``RequestError``
    (``handler_error``) for a result nested deeper than ``MAX_RESULT_DEPTH``.

    Iterative, with its own stack: a handler's result is untrusted (an echo of a hostile request is one), and a
    recursive walk failed every request of the micro-batch with a RecursionError. A container met twice (shared,
    or holding itself) is walked once."""
    pending: list[tuple[Any, int]] = [(value, 0)]
    seen: set[int] = set()
    while pending:
        value, depth = pending.pop()
        if not isinstance(value, dict | list | tuple):
            if not _scalar_finite(value):
                return False
            continue
        if depth >= MAX_RESULT_DEPTH:
            raise RequestError(f"result is nested deeper than {MAX_RESULT_DEPTH} levels", ErrorCode.HANDLER_ERROR)
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, dict):
            pending.extend((item, depth + 1) for item in value.values())
            continue
        floats_finite = _floats_finite(value)
        if floats_finite is False:
            return False
        if floats_finite is None:
            pending.extend((item, depth + 1) for item in value)
    return True


def _scalar_finite(value: Any) -> bool:
    """A float, or a numpy array or scalar of floats or complex numbers, holds no NaN or infinity."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, np.ndarray | np.floating) and value.dtype.kind in "fc":
        return bool(np.isfinite(value).all())
    return True


def _floats_finite(values: list[Any] | tuple[Any, ...]) -> bool | None:
    """The fast path for a vector of floats: whether all are finite; None when it is not all numbers (then each
    item is checked on its own)."""
    if not values or not isinstance(values[0], float):
        return None
    try:
        return all(map(math.isfinite, values))
    except TypeError:
        return None


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
                self.inbox.put(micro_batch, timeout=_POLL_S)
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
        self._emit(micro_batch.requests)

    def _dispatch(self) -> None:
        while not self._stopping.is_set():
            if not self._slots.acquire(timeout=_POLL_S):
                continue
            try:
                batch = self._batches.next_batch(_POLL_S, self._prefetching)
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
                request.reply_value = _reply_value(request, result)
            except RequestError as exc:  # this result alone: e.g. an OIP request asked for an output it lacks
                request.fail(exc)

    def _emit_micro_batch(self, micro_batch: MicroBatch) -> None:
        if self._settle(micro_batch):
            self._hand_on(micro_batch)


def _reply_value(request: Request, result: Any) -> bytes:
    """The reply value of one result; ``RequestError`` when it cannot be one."""
    if isinstance(result, RequestError):
        raise result
    encoded = _json_reply(result) if request.reply_format is None else None
    # orjson writes NaN and infinity as null, so kinference's JSON without a null holds neither: the walk of the
    # result (``finite``, a few microseconds for an embedding) is left for a value with a null in it, or one that did
    # not encode (whose error is then the same as before: NaN first). orjson encodes nothing nested deeper than
    # ``finite`` accepts, so an encoded value never skips its depth error either. Other reply formats write NaN as
    # it is: always walked.
    if encoded is not None and b"null" not in encoded:
        return encoded
    if not finite(result):
        # JSON has no NaN or infinity (orjson would write null): a client must not mistake a broken output for a
        # value.
        raise RequestError("result holds NaN or infinity", ErrorCode.HANDLER_ERROR)
    if encoded is not None:
        return encoded
    try:
        return encode_result(result) if request.reply_format is None else request.reply_format.response(result)
    except TypeError as exc:
        raise RequestError(f"result is not JSON-serialisable: {exc}", ErrorCode.HANDLER_ERROR) from exc


def _json_reply(result: Any) -> bytes | None:
    """kinference's JSON reply value of ``result``; None when it does not encode (``_reply_value`` says why)."""
    try:
        return encode_result(result)
    except TypeError:
        return None


def _untraced(_name: str, work: Callable[[MicroBatch], None]) -> Callable[[MicroBatch], None]:
    return work
