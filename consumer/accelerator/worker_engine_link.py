"""A worker's link to the generative engine in its device process (``device_engine``): the ``GenerativePort``
that the worker's ``GenerativeRunner`` drives when the engine runs in the device process.

One connection per worker and model (a Unix ``SOCK_SEQPACKET`` socket, as ``worker_link``'s; no arena: what
crosses is text). ``submit`` and ``cancel`` each send one message (``wire.Submit``, ``wire.Cancel``); the device
process sends back the events of this worker's requests, a decoding step's worth in one message (``wire.Events``),
which ``events`` (the drain thread) reads.

A device process that dies loses what it was generating. The link connects again (the supervisor restarts the
device process meanwhile) and then reports each request it had handed over as ``lost``: ``GenerativeRunner`` generates
it again, under a new attempt, and clients drop the lost attempt's chunks. A request that finds no device process
for ``wait_s`` fails with ``handler_error``, answered, as a micro-batch does (``worker_link``). Either way the
request was never answered before, so the commit rule is untouched.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from pathlib import Path

from kinference.consumer.accelerator import wire
from kinference.consumer.accelerator.worker_link import DeviceUnavailable
from kinference.handlers.generative import SERVING, TERMINAL, EngineHealth, Event, Prompt

log = logging.getLogger(__name__)

_RETRY_S = 0.1
_HELLO_TIMEOUT_S = 10.0


class EngineLink:
    """``GenerativePort`` of model ``model`` in the device process at ``path``: ``connect()``, then ``submit``/
    ``cancel`` from any thread and ``events`` from one; ``close()``."""

    def __init__(self, path: Path, model: str, wait_s: float) -> None:
        self.path = Path(path)
        self.model = model
        self._wait_s = wait_s
        self._socket: socket.socket | None = None
        self._lock = threading.Lock()
        """Held to send, and to change the socket or ``_handed``: a request is either sent on the socket it finds,
        or left in ``_handed`` for the next connection to report lost."""
        self._handed: dict[str, float] = {}
        """Requests handed to the device process and not ended, with when each began to wait for one that is up."""
        self._kv_cache_use: float | None = None

    def connect(self) -> None:
        """Return once the device process serves the model (it has loaded it): a worker joins the group only then.
        ``DeviceUnavailable`` after ``wait_s``."""
        deadline = time.monotonic() + self._wait_s
        while (sock := self._open()) is None:
            if time.monotonic() >= deadline:
                raise DeviceUnavailable(f"no device process served model {self.model} at {self.path} for "
                                        f"{self._wait_s:g} s")
            time.sleep(_RETRY_S)
        with self._lock:
            self._socket = sock

    # --- the port

    def submit(self, request_id: str, prompt: Prompt) -> None:
        """Hand the request over; with no device process up, it waits for the next (``events`` reports it lost
        once one is up, or failed past ``wait_s``)."""
        with self._lock:
            self._handed[request_id] = time.monotonic()
            self._send(wire.Submit(request_id, prompt))

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._send(wire.Cancel(request_id))

    def events(self, timeout_s: float) -> list[Event]:
        sock = self._socket
        if sock is None:
            return self._while_down(timeout_s)
        events: list[Event] = []
        try:
            readable, _, _ = select.select([sock], [], [], timeout_s)
            while readable:
                message = wire.receive_to_worker(sock)
                if not isinstance(message, wire.Events):
                    raise ConnectionAbortedError("the device process closed the connection" if message is None else
                                                 f"the device process sent {type(message).__name__} on an engine link")
                events += message.events
                if message.kv_cache_use is not None:  # an engine's refusal says nothing of its cache
                    self._kv_cache_use = message.kv_cache_use
                readable, _, _ = select.select([sock], [], [], 0)
        except (OSError, ValueError) as exc:  # ValueError: select on a socket closed meanwhile by a failed send
            with self._lock:
                self._drop(sock, exc)
        with self._lock:
            for event in events:
                if event.kind in TERMINAL:
                    self._handed.pop(event.request_id, None)
        return events

    @property
    def kv_cache_use(self) -> float | None:
        return self._kv_cache_use

    @property
    def health(self) -> EngineHealth:
        """Serving: an engine replaced in the device process is named by that process's own health checks."""
        return SERVING

    def close(self) -> None:
        """The device process cancels this worker's sequences when its connection closes."""
        with self._lock:
            if self._socket is not None:
                self._socket.close()
                self._socket = None

    # --- a device process that went away

    def _send(self, message: wire.Submit | wire.Cancel) -> None:
        sock = self._socket
        if sock is None:
            return  # a submit waits in ``_handed``: reported lost at the next connection; a cancel has no object
        try:
            wire.send(sock, message)
        except OSError as exc:
            self._drop(sock, exc)

    def _drop(self, sock: socket.socket, exc: Exception) -> None:
        """(Under the lock.) The connection is broken: every request handed over waits for the next device process
        from now on."""
        if self._socket is not sock:
            return
        log.warning("model %s: the device process is gone (%s); its generations start again once it is back",
                    self.model, exc)
        sock.close()
        self._socket = None
        now = time.monotonic()
        self._handed = dict.fromkeys(self._handed, now)

    def _while_down(self, timeout_s: float) -> list[Event]:
        """Connect again: every request handed to the old device process is then ``lost``. Until then, those that
        waited ``wait_s`` for one fail."""
        sock = self._open()
        if sock is not None:
            with self._lock:
                lost, self._handed = list(self._handed), {}
                self._socket = sock
            log.warning("model %s: a device process serves it again; %d generations start again", self.model,
                        len(lost))
            return [Event(request_id, "lost") for request_id in lost]
        time.sleep(min(timeout_s, _RETRY_S))
        cutoff = time.monotonic() - self._wait_s
        with self._lock:
            failed = [request_id for request_id, since in self._handed.items() if since <= cutoff]
            for request_id in failed:
                del self._handed[request_id]
        return [Event(request_id, "error", f"no device process served the model for {self._wait_s:g} s")
                for request_id in failed]

    def _open(self) -> socket.socket | None:
        """A connection to a device process that serves the model (it has loaded it); None when there is none."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.settimeout(_HELLO_TIMEOUT_S)
            sock.connect(str(self.path))
            wire.send(sock, wire.OpenEngine(self.model))
            answer = wire.receive_to_worker(sock)
            if not isinstance(answer, wire.Ready):
                raise ConnectionRefusedError(answer.message if isinstance(answer, wire.Failed)
                                             else "the device process closed the connection")
            sock.settimeout(None)
        except (OSError, wire.WireError):
            sock.close()
            return None
        return sock
