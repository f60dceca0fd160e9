"""Every message between a worker and its device process, and their one framing, for both links.

A worker opens one connection (a Unix ``SOCK_SEQPACKET`` socket in the host directory, mode 0600) per inference
thread for the batch link (``worker_link`` → ``device_server``) and one per generative model for the engine link
(``worker_engine_link`` → ``device_engine``). Each connection opens with one message that says which it is:
``Hello`` (a batch link; the worker's arena, ``arena``, rides with it as a file descriptor) or ``OpenEngine``.

Messages are msgspec Structs tagged by class, encoded as msgpack and decoded against the union of what the
receiving side accepts (``ToDevice``, ``ToWorker``): a message of the wrong shape is a ``WireError``, never a
half-read tuple. The micro-batches' own data (a handler's ``preprocess`` result, its ``inference`` outputs) crosses
as the arena's bytes (``Infer.inputs``, ``Outputs.outputs``: a pickle whose tensors lie in the shared memory).

Framing: a message longer than ``FRAGMENT_BYTES`` goes in several packets, each prefixed ``+`` (more follows) or
``.`` (the last), so no message is bounded by the socket's send buffer (a ``SOCK_SEQPACKET`` packet must fit it:
about 208 KiB by default).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import TypeVar

import msgspec

from kinference.errors import KinferenceError
from kinference.handlers.generative import Event, Prompt

FRAGMENT_BYTES = 64 << 10
"""The most bytes of a message in one packet: well within the smallest send buffer a host sets."""
_MORE, _LAST = b"+", b"."


class WireError(KinferenceError):
    """A message that is not one the receiving side accepts (a bug, or a process of another version)."""


# --- the batch link


class Hello(msgspec.Struct, tag="hello", frozen=True):
    """A batch link's first message; the worker's arena (``arena_bytes``) is its file descriptor."""

    arena_bytes: int


class Ping(msgspec.Struct, tag="ping", frozen=True):
    """Answered ``Ready`` once the device process serves (it loaded and warmed up its models)."""


class Infer(msgspec.Struct, tag="infer", frozen=True):
    """One micro-batch of ``model``: ``inputs`` as the arena wrote them (``Arena.write_inputs``)."""

    model: str
    inputs: bytes


class Ready(msgspec.Struct, tag="ready", frozen=True):
    """The answer to ``Ping``, and to ``OpenEngine``."""


class Outputs(msgspec.Struct, tag="outputs", frozen=True):
    """A micro-batch's outputs, one row per row of its inputs, as the arena wrote them (``Arena.write_outputs``)."""

    outputs: bytes


class Failure(StrEnum):
    ERROR = "error"
    """The handler raised (or its outputs did not fit): this call alone fails."""
    HUNG = "hung"
    """The device batch that held this call made no progress for ``--device-hang-s``: the device process is being
    replaced."""
    REFUSED = "refused"
    """The device process does not serve the model asked for."""


class Failed(msgspec.Struct, tag="failed", frozen=True):
    kind: Failure
    message: str


# --- the engine link


class OpenEngine(msgspec.Struct, tag="open_engine", frozen=True):
    """An engine link's first message: the generative model whose engine the connection drives."""

    model: str


class Submit(msgspec.Struct, tag="submit", frozen=True):
    request_id: str
    prompt: Prompt


class Cancel(msgspec.Struct, tag="cancel", frozen=True):
    request_id: str


class Events(msgspec.Struct, tag="events", frozen=True):
    """A decoding step's events of one worker's requests, and the engine's KV cache use (None: unchanged)."""

    events: list[Event]
    kv_cache_use: float | None = None


ToDevice = Hello | Ping | Infer | OpenEngine | Submit | Cancel
"""What a worker sends."""
ToWorker = Ready | Outputs | Failed | Events
"""What a device process sends."""

_Message = TypeVar("_Message")
_ENCODER = msgspec.msgpack.Encoder()
_TO_DEVICE = msgspec.msgpack.Decoder(ToDevice)
_TO_WORKER = msgspec.msgpack.Decoder(ToWorker)


def send(sock: socket.socket, message: ToDevice | ToWorker, fds: Sequence[int] = ()) -> None:
    """``message`` in as many packets as it takes, ``fds`` with the first; the caller holds the socket's send lock.
    ``OSError`` on a broken connection."""
    data = _ENCODER.encode(message)
    view = memoryview(data)
    for start in range(0, max(len(data), 1), FRAGMENT_BYTES):
        end = start + FRAGMENT_BYTES
        # One packet of both: no copy to join them.
        packet: list[bytes | memoryview] = [_LAST if end >= len(data) else _MORE, view[start:end]]
        if start == 0 and fds:
            socket.send_fds(sock, packet, list(fds))
        else:
            sock.sendmsg(packet)


def receive_to_device(sock: socket.socket) -> tuple[ToDevice, list[int]] | None:
    """The next message from a worker and the descriptors that came with it; None when the worker closed the
    connection. ``OSError`` on a broken one, ``WireError`` on a message of the wrong shape."""
    received = _receive(sock, _with_fds)
    if received is None:
        return None
    data, fds = received
    return _decoded(_TO_DEVICE, data), fds


def receive_call(sock: socket.socket) -> ToDevice | None:
    """The next message from a worker on a link that sends no more descriptors (past its first message)."""
    received = _receive(sock, _without_fds)
    return None if received is None else _decoded(_TO_DEVICE, received[0])


def receive_to_worker(sock: socket.socket) -> ToWorker | None:
    """The next message from the device process; None when it closed the connection."""
    received = _receive(sock, _without_fds)
    return None if received is None else _decoded(_TO_WORKER, received[0])


def _decoded(decoder: msgspec.msgpack.Decoder[_Message], data: bytes | memoryview) -> _Message:
    try:
        return decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise WireError(f"a message of the wrong shape on the device link: {exc}") from exc


def _with_fds(sock: socket.socket) -> tuple[bytes, list[int]]:
    packet, fds, _flags, _address = socket.recv_fds(sock, FRAGMENT_BYTES + 1, 1)
    return packet, fds


def _without_fds(sock: socket.socket) -> tuple[bytes, list[int]]:
    return sock.recv(FRAGMENT_BYTES + 1), []


def _receive(sock: socket.socket, packets: Callable[[socket.socket], tuple[bytes, list[int]]]
             ) -> tuple[bytes | memoryview, list[int]] | None:
    """One message's packets joined (a message of one packet is a view of it: not copied), and their
    descriptors."""
    packet, fds = packets(sock)
    if packet[:1] == _LAST:
        return memoryview(packet)[1:], fds
    parts = []
    while packet:
        parts.append(packet[1:])
        if packet[:1] == _LAST:
            return b"".join(parts), fds
        packet, more_fds = packets(sock)
        fds += more_fds
    return None
