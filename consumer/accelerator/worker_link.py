"""A worker's side of the batch link to its device process: ``DeviceLink.infer`` runs one micro-batch's inference there,
and ``DeviceInference`` is the pipeline's inference port that does so.

Each inference thread of the worker has its own connection (a Unix ``SOCK_SEQPACKET`` socket: one message is one call)
and its own shared-memory arena (``arena``), so a call is: inputs into the arena, one message out (``wire.Infer``), one
message back (``wire.Outputs``), outputs copied out of the arena. What is not a tensor crosses in the message, in as
many packets as it takes (``wire``): a message has no size limit. The thread waits for the reply with the GIL released,
as it would wait for a GPU.

A device process that dies (or restarts) loses nothing: the call's inputs are still in the arena, so the thread connects
again, hands the arena over again and sends the same call, for up to ``wait_s``; the supervisor restarts the device
process meanwhile. Past ``wait_s`` the call fails (``DeviceUnavailable``), and with it that micro-batch's requests, with
``handler_error``: answered, never lost. A device batch that hung there is answered ``device_hung`` by the device
process itself (``DeviceHung``), which is then replaced. The commit rule is untouched: a request's offset is committed
only once its reply is acknowledged, whatever happened to the device process before.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from pathlib import Path
from typing import Any

from kinference.consumer.accelerator import wire
from kinference.consumer.accelerator.arena import Arena
from kinference.errors import KinferenceError, ServiceFault
from kinference.protocol import ErrorCode

log = logging.getLogger(__name__)

_RETRY_S = 0.1


class DeviceError(KinferenceError):
    """The device process failed this call (the handler raised there): the micro-batch fails with its message."""


class DeviceHung(ServiceFault):
    """The device batch that held this call made no progress for ``--device-hang-s``: its requests fail with
    ``device_hung``, and the device process is replaced."""

    code = ErrorCode.DEVICE_HUNG


class DeviceUnavailable(KinferenceError):
    """No device process answered for ``wait_s``."""


class DeviceLink:
    """``infer(model, inputs)`` from any inference thread; ``close()`` once they have stopped."""

    def __init__(self, path: Path, arena_bytes: int, wait_s: float) -> None:
        self.path = Path(path)
        self._arena_bytes = arena_bytes
        self._wait_s = wait_s
        self._local = threading.local()
        self._connections: list[_Connection] = []
        self._lock = threading.Lock()

    def wait_ready(self) -> None:
        """Return once the device process answers (it has loaded and warmed up its models): a worker joins the group
        only then. ``DeviceUnavailable`` after ``wait_s``."""
        self._connection().call(wire.Ping())

    def infer(self, model: str, inputs: Any) -> Any:
        """``inputs`` (a ``preprocess`` result) run by ``model`` in the device process; its outputs, one per row.
        ``DeviceError`` when the handler failed there, ``DeviceHung``, ``DeviceUnavailable``, ``ArenaFull``."""
        connection = self._connection()
        reply = connection.call(wire.Infer(model, connection.arena.write_inputs(inputs)))
        if not isinstance(reply, wire.Outputs):
            raise DeviceError(f"the device process answered a call with {type(reply).__name__}")
        return connection.arena.read_outputs(reply.outputs)

    def close(self) -> None:
        with self._lock:
            for connection in self._connections:
                connection.close()
            self._connections.clear()

    def _connection(self) -> _Connection:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            connection = self._local.connection = _Connection(self.path, Arena(self._arena_bytes), self._wait_s)
            with self._lock:
                self._connections.append(connection)
        return connection


class DeviceInference:
    """The pipeline's inference port for a model that runs in the device process: each inference thread waits for
    the device process to serve, then hands its micro-batches there."""

    def __init__(self, link: DeviceLink, model: str) -> None:
        self._link = link
        self._model = model

    def prepare(self) -> None:
        """The device process warmed the model up: wait until it answers."""
        self._link.wait_ready()

    def infer(self, inputs: Any) -> Any:
        return self._link.infer(self._model, inputs)


class _Connection:
    """One inference thread's socket and arena."""

    def __init__(self, path: Path, arena: Arena, wait_s: float) -> None:
        self._path = path
        self.arena = arena
        self._wait_s = wait_s
        self._socket: socket.socket | None = None

    def call(self, message: wire.Ping | wire.Infer) -> wire.ToWorker:
        """Send ``message`` and return the answer; on a lost device process, connect again and send it again, until
        ``wait_s`` has passed without an answer. ``Failed`` answers raise."""
        deadline = time.monotonic() + self._wait_s
        while True:
            try:
                reply = self._exchange(message)
            except OSError as exc:
                self._drop()
                if time.monotonic() >= deadline:
                    raise DeviceUnavailable(f"the device process at {self._path} did not answer for "
                                            f"{self._wait_s:g} s (last error: {exc})") from exc
                time.sleep(_RETRY_S)
                continue
            if isinstance(reply, wire.Failed):
                raise (DeviceHung if reply.kind is wire.Failure.HUNG else DeviceError)(reply.message)
            return reply

    def _exchange(self, message: wire.Ping | wire.Infer) -> wire.ToWorker:
        sock = self._socket if self._socket is not None else self._connect()
        try:
            wire.send(sock, message)
            reply = wire.receive_to_worker(sock)
        except wire.WireError as exc:
            raise ConnectionAbortedError(str(exc)) from exc
        if reply is None:
            raise ConnectionResetError("the device process closed the connection")
        return reply

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect(str(self._path))
            wire.send(sock, wire.Hello(self.arena.size), fds=[self.arena.fd])
        except OSError:
            sock.close()
            raise
        self._socket = sock
        return sock

    def _drop(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    def close(self) -> None:
        self._drop()
        self.arena.close()
