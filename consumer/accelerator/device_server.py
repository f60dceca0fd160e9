"""The device process's server: one device process per GPU, the only copy of the model and of the CUDA context, fed by
the workers.

``kinference serve`` with a device process (``--device-process``, on by default with CUDA) runs a supervisor, one
device process per GPU and ``--workers`` worker processes. A worker does all the per-message work (Kafka,
decoding, admission, tokenisation, collation, postprocess, reply encoding, produce, commit) and hands each
micro-batch to its device process (``worker_link``; the messages: ``wire``). Here:

1. ``DeviceServer`` accepts one connection per worker inference thread; a reader thread per connection turns each
   call into a ``Job`` (its inputs read in place from the connection's shared arena, its rows counted as the
   handler makes them: ``Handler.rows``) on one queue;
2. the reader then runs batches itself while one of the ``device_threads`` slots is free (a CUDA stream each), so a
   call that finds the device idle starts at once, with no hand-off to another thread; a busy device's calls wait in
   the queue, and whichever thread finishes a batch takes every job waiting, up to ``device_batch_size`` rows, of
   one model: the device batch grows with the load of all workers together, not with 1/N of it;
3. the handler ``merge``s them into one batch (padded to a shape bucket), runs ``inference`` once, and each job's
   rows go back to its worker through its arena. A batch that fails is run again one job at a time, so that one
   worker's bad micro-batch fails alone.
4. a watchdog answers the calls of a device batch that runs past ``hang_s`` (``--device-hang-s``) with
   ``Failure.HUNG`` (``device_hung``) and reports the process hung (``hung``): the supervisor replaces it, and
   the calls still waiting here are sent again by their workers to the new one.

A generative model's continuous-batching engine (issue 28) is served beside them (``device_engine``): a worker's
connection that opens with ``OpenEngine`` instead of ``Hello`` is that worker's link to the engine.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kinference.consumer.accelerator import wire
from kinference.consumer.accelerator.arena import Arena
from kinference.consumer.accelerator.device_engine import DeviceEngine
from kinference.handlers.base import Handler

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

log = logging.getLogger(__name__)

_ACCEPT_POLL_S = 0.2
_DRAIN_POLL_S = 0.1


@dataclass(frozen=True)
class DeviceBatching:
    """How the device process batches the workers' micro-batches."""

    max_rows: int
    """The most rows (items) in one device batch: ``device_batch_size``, or what the calibration chose."""
    threads: int = 1
    """Device batches running at once (each on its reader thread's CUDA stream), so one merges or hands back while
    another's batch runs."""
    hang_s: float = 300.0
    """A device batch running longer than this has hung (``--device-hang-s``)."""


@dataclass(eq=False)
class Connection:
    """A worker inference thread's socket and arena."""

    sock: socket.socket
    arena: Arena
    lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, message: wire.ToWorker) -> None:
        """Send one reply; a worker gone meanwhile is no error here (its requests are replayed from Kafka)."""
        try:
            with self.lock:
                wire.send(self.sock, message)
        except OSError as exc:
            log.info("a worker left before its reply: %s", exc)


@dataclass(eq=False)
class Job:
    """One worker call: a preprocessed micro-batch of ``rows`` rows for ``model``; answered once (``answer``)."""

    connection: Connection
    model: str
    rows: int
    inputs: Any
    _answered: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def answer(self, outputs: Any) -> None:
        """Its rows of a device batch's outputs, through the arena."""
        try:
            message: wire.ToWorker = wire.Outputs(self.connection.arena.write_outputs(outputs))
        except Exception as exc:  # the outputs could not be written (ArenaFull): the call fails, saying why
            message = wire.Failed(wire.Failure.ERROR, f"cannot hand the outputs back: {exc}")
        self._send(message)

    def fail(self, kind: wire.Failure, message: str) -> None:
        self._send(wire.Failed(kind, message))

    def _send(self, message: wire.ToWorker) -> None:
        """Only the first answer goes: a hung batch's calls are answered by the watchdog, and the batch may still
        return after that."""
        with self._lock:
            if self._answered:
                return
            self._answered = True
        self.connection.send(message)


@dataclass(eq=False)
class _Running:
    """A device batch in the model's hands, since ``started`` (``time.monotonic()``)."""

    model: str
    jobs: list[Job]
    started: float


class DeviceServer:
    """``start()`` listens on ``path`` and serves ``handlers`` and ``engines`` (by model name) until ``stop()``."""

    def __init__(self, handlers: dict[str, Handler], path: Path, batching: DeviceBatching,
                 metrics: DeviceMetrics, engines: dict[str, DeviceEngine] | None = None,
                 on_hung: Callable[[], None] | None = None) -> None:
        """``on_hung``: called once, when this process has hung (``hung``)."""
        self._handlers = handlers
        self._on_hung = on_hung
        self._engines = engines or {}
        self.path = Path(path)
        self._batching = batching
        self._metrics = metrics
        self._jobs: deque[Job] = deque()
        self._jobs_lock = threading.Lock()
        self._slots = threading.Semaphore(batching.threads)
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._connections: set[Connection] = set()
        self._listener: socket.socket | None = None
        self._running: set[_Running] = set()
        self._running_lock = threading.Lock()
        self.crashed: list[str] = []
        self.hung: str | None = None
        """Why this process made no progress (a device batch ran past ``hang_s``): it is to be replaced."""

    def start(self) -> DeviceServer:
        self.path.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(str(self.path))
        os.chmod(self.path, 0o600)  # only this user's workers
        listener.listen(256)
        listener.settimeout(_ACCEPT_POLL_S)
        self._listener = listener
        for name, engine in self._engines.items():
            self._spawn(engine.pump, f"kinference-device-engine-{name}")
        self._spawn(self._accept, "kinference-device-accept")
        self._spawn(self._watch, "kinference-device-watchdog")
        return self

    @property
    def alive(self) -> bool:
        return not self.crashed and all(thread.is_alive() for thread in self._threads)

    @property
    def waiting(self) -> int:
        return len(self._jobs)

    @property
    def hang_s(self) -> float:
        return self._batching.hang_s

    @property
    def connected(self) -> int:
        """Workers' connections open now: batch links and engine links."""
        return len(self._connections) + sum(engine.connected for engine in self._engines.values())

    def stalled_s(self) -> float:
        """How long the oldest device batch running now has run, or an engine holding requests has not stepped; 0
        when none runs."""
        with self._running_lock:
            oldest = min((running.started for running in self._running), default=None)
        batches = 0.0 if oldest is None else time.monotonic() - oldest
        return max([batches, *(engine.stalled_s() for engine in self._engines.values())])

    def drain(self, timeout_s: float) -> bool:
        """Serve on until every worker has closed its connections (they drain on the same signal: a SIGTERM to the
        whole process group reaches them and this process at once), for ``timeout_s`` at most. False if some
        worker is still connected then."""
        deadline = time.monotonic() + timeout_s
        while self.connected and time.monotonic() < deadline:
            time.sleep(_DRAIN_POLL_S)
        return not self.connected

    def stop(self, timeout_s: float) -> None:
        """Stop taking calls, finish the batches running (within ``timeout_s``), close every connection; calls still
        waiting are sent again by their workers to the next device process (or fail after ``device_wait_s``)."""
        self._stopping.set()
        for engine in self._engines.values():
            engine.stop()
        deadline = time.monotonic() + timeout_s
        for _ in range(self._batching.threads):  # every slot back: no batch runs any more
            if not self._slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
                log.warning("stop: a device batch still runs after %.0f s", timeout_s)
                break
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        for connection in list(self._connections):
            connection.sock.close()
        if self._listener is not None:
            self._listener.close()
        self.path.unlink(missing_ok=True)

    def _spawn(self, target: Callable[..., None], name: str, *args: Any) -> None:
        thread = threading.Thread(target=self._guarded, args=(target, *args), name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _guarded(self, target: Callable[..., None], *args: Any) -> None:
        try:
            target(*args)
        except BaseException as exc:  # a device thread must never die silently: /healthz says so
            self.crashed.append(f"{threading.current_thread().name}: {exc!r}")
            log.critical("device thread %s died", threading.current_thread().name, exc_info=True)
            raise

    # --- progress

    def _watch(self) -> None:
        """Answer the calls of a device batch that runs past ``hang_s`` with ``Failure.HUNG``, at once: the model
        call cannot be taken back from its thread (Python cannot stop it), so this process is reported hung and
        replaced (``progress``)."""
        limit = self._batching.hang_s
        while not self._stopping.wait(min(0.2, limit / 4)):
            now = time.monotonic()
            with self._running_lock:
                hung = [running for running in self._running if now - running.started > limit]
            for running in hung:
                why = (f"a device batch of model {running.model!r} has run {now - running.started:.1f} s, past "
                       f"--device-hang-s ({limit:g} s)")
                for job in running.jobs:
                    job.fail(wire.Failure.HUNG, why)
                self._report_hung(why)
            for name, engine in self._engines.items():
                if (stalled := engine.stalled_s()) > limit:
                    why = (f"the engine of model {name!r} has not stepped for {stalled:.1f} s, past "
                           f"--device-hang-s ({limit:g} s)")
                    engine.fail_all(f"device_hung: {why}")
                    self._report_hung(why)

    def _report_hung(self, why: str) -> None:
        """Only once what it held is answered: the supervisor kills this process on seeing it."""
        if self.hung is None:
            log.error("%s: what it held failed; this device process is to be replaced", why)
            self.hung = why
            if self._on_hung is not None:
                self._on_hung()

    # --- connections

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stopping.is_set():
                    return
                raise
            sock.settimeout(None)
            reader = threading.Thread(target=self._guarded, args=(self._read, sock), name="kinference-device-read",
                                      daemon=True)
            reader.start()

    def _read(self, sock: socket.socket) -> None:
        """One worker connection until it closes: its first message says which link it is (``wire``)."""
        try:
            received = wire.receive_to_device(sock)
        except (OSError, wire.WireError) as exc:
            received = None
            log.warning("a connection failed to start (%s); closed", exc)
        match received:
            case (wire.Hello(arena_bytes), [fd]):
                self._serve_batches(Connection(sock, Arena(arena_bytes, fd)))
            case (wire.OpenEngine(model), []):
                self._serve_engine(sock, model)
            case _:
                if received is not None:
                    log.warning("a connection did not open with Hello and its arena, or OpenEngine; closed")
                    for fd in received[1]:
                        os.close(fd)
                sock.close()

    def _serve_engine(self, sock: socket.socket, model: str) -> None:
        """A worker's link to a generative model: its engine takes the connection until it closes."""
        engine = self._engines.get(model)
        if engine is None:
            with contextlib.suppress(OSError):
                wire.send(sock, wire.Failed(wire.Failure.REFUSED, f"model {model!r} does not generate here"))
            sock.close()
            return
        engine.serve(sock)

    def _serve_batches(self, connection: Connection) -> None:
        self._connections.add(connection)
        try:
            while not self._stopping.is_set():
                try:
                    received = wire.receive_call(connection.sock)
                except (OSError, wire.WireError) as exc:
                    log.warning("a worker's batch link failed (%s); closed", exc)
                    return
                if received is None:
                    return
                self._call(connection, received)
        finally:
            self._connections.discard(connection)
            connection.sock.close()
            connection.arena.close()  # a job of it still queued keeps its mapping until it has run

    def _call(self, connection: Connection, message: wire.ToDevice) -> None:
        match message:
            case wire.Ping():
                connection.send(wire.Ready())
            case wire.Infer(model, inputs):
                handler = self._handlers.get(model)
                if handler is None:
                    connection.send(wire.Failed(wire.Failure.REFUSED, f"model {model!r} does not run in this device "
                                                "process"))
                    return
                read = connection.arena.read_inputs(inputs)
                with self._jobs_lock:
                    self._jobs.append(Job(connection, model, handler.rows(read), read))
                self._run_while_free()
            case _:
                connection.send(wire.Failed(wire.Failure.ERROR, f"not a batch link's call: {type(message).__name__}"))

    # --- batches

    def _run_while_free(self) -> None:
        """Run device batches on this thread while a slot is free and jobs wait. After giving the slot back, look
        again: a job queued while this thread held the last slot found none free, and would wait for the next
        call otherwise."""
        while self._jobs and not self._stopping.is_set() and self._slots.acquire(blocking=False):
            try:
                while jobs := self._take():
                    self._run_batch(jobs)
            finally:
                self._slots.release()

    def _take(self) -> list[Job]:
        """Every waiting job of the first one's model, up to ``max_rows`` rows (at least the first); [] if none."""
        with self._jobs_lock:
            if not self._jobs or self._stopping.is_set():
                return []
            first = self._jobs.popleft()
            jobs, rows, others = [first], first.rows, []
            while self._jobs and rows < self._batching.max_rows:
                job = self._jobs.popleft()
                if job.model != first.model or rows + job.rows > self._batching.max_rows:
                    others.append(job)
                    continue
                jobs.append(job)
                rows += job.rows
            self._jobs.extendleft(reversed(others))
            return jobs

    def _run_batch(self, jobs: list[Job]) -> None:
        rows = sum(job.rows for job in jobs)
        started = time.perf_counter()
        try:
            outputs = self._infer(jobs, rows)
        except Exception as exc:
            if len(jobs) > 1:  # one worker's bad micro-batch must not fail the others': each alone
                for job in jobs:
                    self._run_batch([job])
                return
            log.warning("model %s failed for a micro-batch of %d rows: %r", jobs[0].model, rows, exc)
            jobs[0].fail(wire.Failure.ERROR, f"{exc!r}")
            return
        self._metrics.observe(jobs[0].model, len(jobs), rows, time.perf_counter() - started)
        start = 0
        for job in jobs:
            job.answer(_rows(outputs, start, job.rows))
            start += job.rows

    def _infer(self, jobs: list[Job], rows: int) -> Any:
        """The merged batch's outputs, one row per row; the watchdog sees it while it runs."""
        handler = self._handlers[jobs[0].model]
        running = _Running(jobs[0].model, jobs, time.monotonic())
        with self._running_lock:
            self._running.add(running)
        try:
            outputs = handler.inference(handler.merge([job.inputs for job in jobs]))
        finally:
            with self._running_lock:
                self._running.discard(running)
        if len(outputs) != rows:
            raise ValueError(f"inference returned {len(outputs)} rows for a batch of {rows} rows")
        return outputs


def _rows(outputs: Sequence[Any], start: int, count: int) -> Any:
    return outputs[start : start + count]


class DeviceMetrics:
    """What the device process exports (prometheus_client's multiprocess mode: the supervisor serves them)."""

    def __init__(self, index: int, registry: CollectorRegistry) -> None:
        from prometheus_client import Counter, Histogram

        device = str(index)
        rows = Histogram("kinference_device_batch_rows", "Items in one device batch (the workers' micro-batches "
                         "merged).", ["device", "model"], buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
                         registry=registry)
        parts = Histogram("kinference_device_batch_parts", "Micro-batches merged into one device batch.",
                          ["device", "model"], buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32), registry=registry)
        busy = Counter("kinference_device_busy_seconds", "Seconds the device process spent in the model's "
                       "merge and inference.", ["device", "model"], registry=registry)
        self._device = device
        self._rows, self._parts, self._busy = rows, parts, busy
        self._children: dict[str, tuple[Any, Any, Any]] = {}

    def observe(self, model: str, parts: int, rows: int, seconds: float) -> None:
        """One device batch: its children of each model looked up once (a label lookup takes a lock and a tuple)."""
        children = self._children.get(model)
        if children is None:
            children = self._children[model] = (self._rows.labels(self._device, model),
                                                 self._parts.labels(self._device, model),
                                                 self._busy.labels(self._device, model))
        rows_child, parts_child, busy_child = children
        rows_child.observe(rows)
        parts_child.observe(parts)
        busy_child.inc(seconds)
