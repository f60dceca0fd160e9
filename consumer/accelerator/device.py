"""The device process: one per GPU, the only copy of the model and of the CUDA context, fed by the workers.

``kinference serve`` with a device process (``--device-process``, on by default with CUDA) runs a supervisor, one
device process per GPU and ``--workers`` worker processes. A worker does all the per-message work (Kafka,
decoding, admission, tokenisation, collation, postprocess, reply encoding, produce, commit) and hands each
micro-batch to its device process (``device_link``). Here:

1. ``DeviceServer`` accepts one connection per worker inference thread; a reader thread per connection turns each
   call into a ``Job`` (its inputs read in place from the connection's shared arena) on one queue;
2. the reader then runs batches itself while one of the ``device_threads`` slots is free (a CUDA stream each), so a
   call that finds the device idle starts at once, with no hand-off to another thread; a busy device's calls wait in
   the queue, and whichever thread finishes a batch takes every job waiting, up to ``device_batch_size`` rows, of
   one model: the device batch grows with the load of all workers together, not with 1/N of it;
3. the handler ``merge``s them into one batch (padded to a shape bucket), runs ``inference`` once, and each job's
   rows go back to its worker through its arena. A batch that fails is run again one job at a time, so that one
   worker's bad micro-batch fails alone.

A generative model's continuous-batching engine (issue 28) is served beside them (``device_engine``): a worker's
connection that opens with ``("generate", model)`` instead of its arena is that worker's link to the engine.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kinference.consumer.accelerator.arena import Arena
from kinference.consumer.accelerator.device_engine import DeviceEngine
from kinference.consumer.accelerator.device_link import MAX_MESSAGE_BYTES
from kinference.consumer.accelerator.engine_link import send_message
from kinference.handlers.base import Handler

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

log = logging.getLogger(__name__)

_ACCEPT_POLL_S = 0.2


@dataclass(frozen=True)
class DeviceBatching:
    """How the device process batches the workers' micro-batches."""

    max_rows: int
    """The most rows (items) in one device batch: ``device_batch_size``, or what the calibration chose."""
    threads: int = 1
    """Device batches running at once (each on its reader thread's CUDA stream), so one merges or hands back while
    another's batch runs."""


@dataclass(eq=False)
class Job:
    """One worker call: a preprocessed micro-batch for ``model``."""

    connection: Connection
    model: str
    rows: int
    inputs: Any


@dataclass(eq=False)
class Connection:
    """A worker inference thread's socket and arena."""

    sock: socket.socket
    arena: Arena
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reply(self, status: str, body: Any) -> None:
        """Send one reply; a worker gone meanwhile is no error here (its requests are replayed from Kafka)."""
        try:
            with self.lock:
                if status == "ok" and body is not None:
                    body = self.arena.write_outputs(body)
                self.sock.sendall(pickle.dumps((status, body), protocol=pickle.HIGHEST_PROTOCOL))
        except OSError as exc:
            log.info("a worker left before its reply: %s", exc)
        except Exception as exc:  # the outputs could not be written (ArenaFull): the call fails, saying why
            self._error(f"cannot hand the outputs back: {exc}")

    def _error(self, message: str) -> None:
        try:
            with self.lock:
                self.sock.sendall(pickle.dumps(("error", message), protocol=pickle.HIGHEST_PROTOCOL))
        except OSError:
            pass


class DeviceServer:
    """``start()`` listens on ``path`` and serves ``handlers`` and ``engines`` (by model name) until ``stop()``."""

    def __init__(self, handlers: dict[str, Handler], path: Path, batching: DeviceBatching,
                 metrics: DeviceMetrics, engines: dict[str, DeviceEngine] | None = None) -> None:
        self._handlers = handlers
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
        self.crashed: list[str] = []

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
        return self

    @property
    def alive(self) -> bool:
        return not self.crashed and all(thread.is_alive() for thread in self._threads)

    @property
    def waiting(self) -> int:
        return len(self._jobs)

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

    def _spawn(self, target: Any, name: str, *args: Any) -> None:
        thread = threading.Thread(target=self._guarded, args=(target, *args), name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _guarded(self, target: Any, *args: Any) -> None:
        try:
            target(*args)
        except BaseException as exc:  # a device thread must never die silently: /healthz says so
            self.crashed.append(f"{threading.current_thread().name}: {exc!r}")
            log.critical("device thread %s died", threading.current_thread().name, exc_info=True)
            raise

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
        """One worker thread's calls, until it disconnects; the first message hands over its arena, or opens a
        generative model's link (``engine_link``)."""
        try:
            data, fds, _flags, _address = socket.recv_fds(sock, MAX_MESSAGE_BYTES, 1)
            if not fds:
                self._serve_engine(sock, data)
                return
            kind, size = pickle.loads(data)
            if kind != "hello" or len(fds) != 1:
                log.warning("a connection did not start with its arena; closed")
                sock.close()
                return
        except (OSError, ValueError, pickle.UnpicklingError) as exc:
            log.warning("a connection failed to start (%s); closed", exc)
            sock.close()
            return
        connection = Connection(sock, Arena(size, fds[0]))
        self._connections.add(connection)
        try:
            self._serve(connection)
        finally:
            self._connections.discard(connection)
            sock.close()
            connection.arena.close()  # a job of it still queued keeps its mapping until it has run

    def _serve_engine(self, sock: socket.socket, hello: bytes) -> None:
        """A worker's link to a generative model: its engine takes the connection until it closes."""
        try:
            _kind, model = pickle.loads(hello[1:])  # one packet: ``engine_link.send_message``'s framing
            engine = self._engines.get(model)
            if engine is None:
                send_message(sock, f"model {model!r} does not generate in this device process")
                sock.close()
                return
        except (OSError, ValueError, TypeError, pickle.UnpicklingError) as exc:
            log.warning("a connection failed to start (%s); closed", exc)
            sock.close()
            return
        engine.serve(sock)

    def _serve(self, connection: Connection) -> None:
        while not self._stopping.is_set():
            try:
                data = connection.sock.recv(MAX_MESSAGE_BYTES)
            except OSError:
                return
            if not data:
                return
            message = pickle.loads(data)  # from a worker of this host: the socket is this user's only (0600)
            if message[0] == "ping":
                connection.reply("ok", None)
                continue
            _, model, rows, meta = message
            if model not in self._handlers:
                connection.reply("error", f"model {model!r} does not run in this device process")
                continue
            job = Job(connection, model, rows, connection.arena.read_inputs(meta))
            with self._jobs_lock:
                self._jobs.append(job)
            self._run_while_free()

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
        handler = self._handlers[jobs[0].model]
        rows = sum(job.rows for job in jobs)
        started = time.perf_counter()
        try:
            outputs = handler.inference(handler.merge([job.inputs for job in jobs]))
            if len(outputs) != rows:
                raise ValueError(f"inference returned {len(outputs)} rows for a batch of {rows} items")
        except Exception as exc:
            if len(jobs) > 1:  # one worker's bad micro-batch must not fail the others': each alone
                for job in jobs:
                    self._run_batch([job])
                return
            log.warning("model %s failed for a micro-batch of %d items: %r", jobs[0].model, rows, exc)
            jobs[0].connection.reply("error", f"{exc!r}")
            return
        self._metrics.observe(jobs[0].model, len(jobs), rows, time.perf_counter() - started)
        start = 0
        for job in jobs:
            job.connection.reply("ok", _rows(outputs, start, job.rows))
            start += job.rows


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

    def observe(self, model: str, parts: int, rows: int, seconds: float) -> None:
        self._rows.labels(self._device, model).observe(rows)
        self._parts.labels(self._device, model).observe(parts)
        self._busy.labels(self._device, model).inc(seconds)
