"""A worker's link to its device process: ``DeviceLink.infer`` runs one micro-batch's inference there.

Each inference thread of the worker has its own connection (a Unix ``SOCK_SEQPACKET`` socket: one message is one
call) and its own shared-memory arena (``arena``), so a call is: inputs into the arena, one small message out,
one small message back, outputs copied out of the arena. The thread waits for the reply with the GIL released,
as it would wait for a GPU.

A device process that dies (or restarts) loses nothing: the call's inputs are still in the arena, so the thread
connects again, hands the arena over again and sends the same call, for up to ``wait_s``; the supervisor restarts
the device process meanwhile. Past ``wait_s`` the call fails (``DeviceUnavailable``), and with it that
micro-batch's requests, with ``handler_error``: answered, never lost. The commit rule is untouched: a request's
offset is committed only once its reply is acknowledged, whatever happened to the device process before.
"""

from __future__ import annotations

import logging
import pickle
import socket
import threading
import time
from pathlib import Path
from typing import Any

from kinference.consumer.accelerator.arena import Arena
from kinference.errors import KinferenceError

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 1 << 20
"""The largest call or reply message; tensors travel in the arena, so a message holds only their layout."""
_RETRY_S = 0.1


class DeviceError(KinferenceError):
    """The device process failed this call (the handler raised there): the micro-batch fails with its message."""


class DeviceUnavailable(KinferenceError):
    """No device process answered for ``wait_s``."""


class DeviceLink:
    """``infer(model, rows, inputs)`` from any inference thread; ``close()`` once they have stopped."""

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
        self._connection().call(("ping",))

    def infer(self, model: str, rows: int, inputs: Any) -> Any:
        """``inputs`` (a ``preprocess`` result of ``rows`` items) run by ``model`` in the device process; its outputs,
        one row per item. ``DeviceError`` when the handler failed there, ``DeviceUnavailable``, ``ArenaFull``."""
        connection = self._connection()
        meta = connection.arena.write_inputs(inputs)
        return connection.arena.read_outputs(connection.call(("infer", model, rows, meta)))

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


class _Connection:
    """One inference thread's socket and arena."""

    def __init__(self, path: Path, arena: Arena, wait_s: float) -> None:
        self._path = path
        self.arena = arena
        self._wait_s = wait_s
        self._socket: socket.socket | None = None

    def call(self, message: tuple[Any, ...]) -> Any:
        """Send ``message`` and return the reply's body; on a lost device process, connect again and send it
        again, until ``wait_s`` has passed without an answer."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        deadline = time.monotonic() + self._wait_s
        while True:
            try:
                reply = self._exchange(data)
            except OSError as exc:
                self._drop()
                if time.monotonic() >= deadline:
                    raise DeviceUnavailable(f"the device process at {self._path} did not answer for "
                                            f"{self._wait_s:g} s (last error: {exc})") from exc
                time.sleep(_RETRY_S)
                continue
            status, body = pickle.loads(reply)  # from our own device process, over a socket only this host sees
            if status == "error":
                raise DeviceError(body)
            return body

    def _exchange(self, data: bytes) -> bytes:
        sock = self._socket if self._socket is not None else self._connect()
        sock.sendall(data)
        reply = sock.recv(MAX_MESSAGE_BYTES)
        if not reply:
            raise ConnectionResetError("the device process closed the connection")
        return reply

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect(str(self._path))
            hello = pickle.dumps(("hello", self.arena.size), protocol=pickle.HIGHEST_PROTOCOL)
            socket.send_fds(sock, [hello], [self.arena.fd])
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
