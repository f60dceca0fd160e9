"""A generative model's engine in the device process: one engine for every worker (issue 28 on issue 27's design).

Each worker connects once per generative model (``worker_engine_link``; the messages: ``wire``) and submits and
cancels its requests; the engine (the model's ``GenerativeHandler``, set up with role ``device``) decodes every
worker's sequences together, one step at a time. One pump thread takes the engine's events and sends each worker
the events of its own requests, a step's worth in one message.

- Request ids are made unique across workers here: the engine knows ``<connection>/<the worker's id>``, and each
  event goes back to its connection under the worker's own id.
- A worker whose connection closes (it stopped, died, or its partitions went to another member that generates them
  again) has its sequences cancelled, so that the engine's places go to requests that someone will answer.
- A worker that takes no events for ``SEND_TIMEOUT_S`` (its drain thread is stuck) is dropped the same way, rather
  than stall every other worker's events behind it.
- The engine's refusal of a request (``submit`` raised) is that request's ``error`` event.
- An engine that stops stepping while it holds requests (its ``events`` call does not return: a wedged model call)
  has stalled (``stalled_s``); past ``--device-hang-s`` the device server ends its requests with an ``error`` event
  (``fail_all``) and reports the process hung, to be replaced.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import struct
import threading
import time
from dataclasses import dataclass, field, replace

from kinference.consumer.accelerator import wire
from kinference.handlers.generative import TERMINAL, Event, GenerativeHandler, Prompt

log = logging.getLogger(__name__)

SEND_TIMEOUT_S = 10
"""How long a worker may leave its events unread before it is dropped."""
_POLL_S = 0.05
"""The pump's wait for events: also how soon it sees ``stop``."""


@dataclass(eq=False)
class _Worker:
    """One worker's connection, and its requests in the engine."""

    sock: socket.socket
    tag: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    requests: set[str] = field(default_factory=set)
    """The engine ids of its requests that have not ended."""

    def engine_id(self, request_id: str) -> str:
        return f"{self.tag}/{request_id}"

    def send(self, events: list[Event], kv_cache_use: float | None) -> bool:
        """False when the worker is gone (or stuck past ``SEND_TIMEOUT_S``)."""
        try:
            with self.lock:
                wire.send(self.sock, wire.Events(events, kv_cache_use))
        except OSError as exc:
            log.info("a worker's connection is gone (%s): its generations are cancelled", exc)
            self.hang_up()
            return False
        return True

    def hang_up(self) -> None:
        """Its reader thread wakes up to a closed connection, and cancels what the worker had."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)


class DeviceEngine:
    """The engine of model ``name``: ``serve(sock)`` on each worker connection's reader thread, ``pump()`` on one
    thread of its own, until ``stop()``."""

    def __init__(self, name: str, handler: GenerativeHandler) -> None:
        self.name = name
        self.handler = handler
        self._lock = threading.Lock()
        self._routes: dict[str, tuple[_Worker, str]] = {}
        """Engine id -> the worker that submitted it, and its id there."""
        self._workers: set[_Worker] = set()
        self._tags = itertools.count()
        self._stopping = threading.Event()
        self._beat = time.monotonic()
        """When the pump last came back from the engine (``stalled_s``)."""

    def serve(self, sock: socket.socket) -> None:
        """One worker's submits and cancels, until its connection closes; then its sequences are cancelled."""
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", SEND_TIMEOUT_S, 0))
        worker = _Worker(sock, next(self._tags))
        with self._lock:
            self._workers.add(worker)
        try:
            with worker.lock:
                wire.send(sock, wire.Ready())
            while (received := wire.receive_to_device(sock)) is not None:
                match received[0]:
                    case wire.Submit(request_id, prompt):
                        self._submit(worker, request_id, prompt)
                    case wire.Cancel(request_id):
                        self._cancel(worker, request_id)
                    case other:
                        log.warning("model %s: a worker sent %s on its engine link; closed", self.name,
                                    type(other).__name__)
                        return
        except (OSError, wire.WireError) as exc:  # a worker gone: the same as a closed connection
            log.debug("model %s: a worker's engine link ended: %s", self.name, exc)
        finally:
            self._forget(worker)
            sock.close()

    def _submit(self, worker: _Worker, request_id: str, prompt: Prompt) -> None:
        engine_id = worker.engine_id(request_id)
        with self._lock:
            self._routes[engine_id] = (worker, request_id)
            worker.requests.add(engine_id)
        try:
            self.handler.submit(engine_id, prompt)
        except Exception as exc:  # the engine refuses this request alone
            with self._lock:
                self._routes.pop(engine_id, None)
                worker.requests.discard(engine_id)
            worker.send([Event(request_id, "error", f"the engine refused the request: {exc}")], None)

    def _cancel(self, worker: _Worker, request_id: str) -> None:
        engine_id = worker.engine_id(request_id)
        if engine_id in worker.requests:
            self.handler.cancel(engine_id)

    def _forget(self, worker: _Worker) -> None:
        """A worker gone: its sequences stop, and their last events go nowhere."""
        with self._lock:
            self._workers.discard(worker)
            ids, worker.requests = list(worker.requests), set()
            for engine_id in ids:
                del self._routes[engine_id]
        for engine_id in ids:
            self.handler.cancel(engine_id)
        if ids:
            log.info("model %s: a worker left; %d of its generations cancelled", self.name, len(ids))

    @property
    def connected(self) -> int:
        """Workers' connections open now."""
        return len(self._workers)

    def pump(self) -> None:
        """Take the engine's events and send each worker its own, until ``stop()``."""
        while not self._stopping.is_set():
            self._beat = time.monotonic()
            events = self.handler.events(_POLL_S)
            if events:
                self._route(events)

    def stalled_s(self) -> float:
        """How long the engine has not come back while it holds requests; 0 when it steps, or holds none."""
        with self._lock:
            holding = bool(self._routes)
        return time.monotonic() - self._beat if holding else 0.0

    def fail_all(self, why: str) -> None:
        """Every request the engine holds ends with an ``error`` event saying ``why`` (the engine hung)."""
        with self._lock:
            routes, self._routes = self._routes, {}
            for worker in self._workers:
                worker.requests.clear()
        by_worker: dict[_Worker, list[Event]] = {}
        for worker, request_id in routes.values():
            by_worker.setdefault(worker, []).append(Event(request_id, "error", why))
        for worker, failed in by_worker.items():
            worker.send(failed, None)

    def _route(self, events: list[Event]) -> None:
        by_worker: dict[_Worker, list[Event]] = {}
        with self._lock:
            for event in events:
                route = self._routes.get(event.request_id)
                if route is None:
                    continue  # its worker is gone
                worker, request_id = route
                if event.kind in TERMINAL:
                    del self._routes[event.request_id]
                    worker.requests.discard(event.request_id)
                by_worker.setdefault(worker, []).append(replace(event, request_id=request_id))
        use = self.handler.kv_cache_use
        for worker, some in by_worker.items():
            worker.send(some, use)

    def stop(self) -> None:
        """The pump stops; every worker's connection closes (the workers connect to the next device process)."""
        self._stopping.set()
        with self._lock:
            workers = list(self._workers)
        for worker in workers:
            worker.hang_up()
