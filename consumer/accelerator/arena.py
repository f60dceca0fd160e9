"""The shared memory between a worker and its device process: one arena per worker connection.

A worker's inference thread and the device process exchange one message per micro-batch, never one per request
(STYLE lesson 21). The message is small: the micro-batch's inputs pickled with each tensor (and numpy array)
replaced by where it lies in the arena, an anonymous shared file (``memfd``) that the worker makes and hands over
once, when it connects (``socket.send_fds``). The device process reads the inputs in place (``torch.frombuffer``:
no copy until the merge packs them into its batch) and writes the outputs to the arena's other half, which the
worker copies out before its next call reuses it.

The arena dies with the last process that maps it: a killed worker or device process leaves nothing in
``/dev/shm``.
"""

from __future__ import annotations

import contextlib
import io
import mmap
import os
import pickle
from typing import Any

import numpy as np
import torch

from kinference.errors import KinferenceError

_ALIGN = 64
"""Each tensor starts on a cache line (and any dtype's alignment)."""


class ArenaFull(KinferenceError):
    """A micro-batch's tensors do not fit in the arena's half: that micro-batch fails, saying how to fix it."""


class Arena:
    """An arena of ``size`` bytes: inputs in the first half (written by the worker), outputs in the second (by the
    device process). ``Arena(size)`` makes a new one; ``Arena(size, fd)`` maps one received from a worker."""

    def __init__(self, size: int, fd: int | None = None) -> None:
        if fd is None:
            fd = os.memfd_create("kinference-arena", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)  # pages are taken only when written
        self.fd = fd
        self.size = size
        self._map = mmap.mmap(fd, size)
        self.half = size // 2

    def write_inputs(self, value: Any) -> bytes:
        """``value`` as a small pickle, its tensors copied into the input half."""
        return self._write(value, 0)

    def write_outputs(self, value: Any) -> bytes:
        return self._write(value, self.half)

    def read_inputs(self, data: bytes) -> Any:
        """The inputs a worker wrote; their tensors are views of the arena, valid until the worker's next call."""
        return _Reader(io.BytesIO(data), self._map, copy=False).load()

    def read_outputs(self, data: bytes) -> Any:
        """The outputs the device process wrote, copied out: the arena is reused by this thread's next call."""
        return _Reader(io.BytesIO(data), self._map, copy=True).load()

    def close(self) -> None:
        # A view of it still referenced keeps the mapping alive (BufferError): it goes when that view does.
        with contextlib.suppress(BufferError):
            self._map.close()
        os.close(self.fd)

    def _write(self, value: Any, start: int) -> bytes:
        out = io.BytesIO()
        writer = _Writer(out, self._map, start, start + self.half)
        writer.dump(value)
        return out.getvalue()


class _Writer(pickle.Pickler):
    """Pickles everything but tensors and arrays, which go into the arena from ``start`` on."""

    def __init__(self, file: io.BytesIO, arena: mmap.mmap, start: int, end: int) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._arena = arena
        self._offset = start
        self._end = end

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.numel():
            source = obj.detach().contiguous()
            if source.device.type != "cpu":
                source = source.cpu()
            offset = self._take(source.numel() * source.element_size())
            target = torch.frombuffer(self._arena, dtype=source.dtype, count=source.numel(), offset=offset)
            target.copy_(source.reshape(-1))
            return ("tensor", offset, str(source.dtype).removeprefix("torch."), tuple(source.shape))
        if isinstance(obj, np.ndarray) and obj.dtype.kind in "biufc" and obj.size:
            array = np.ascontiguousarray(obj)
            offset = self._take(array.nbytes)
            view = np.frombuffer(self._arena, dtype=array.dtype, count=array.size, offset=offset)
            view[:] = array.reshape(-1)
            return ("array", offset, array.dtype.str, array.shape)
        return None  # pickled as it is (an empty tensor too: nothing to share)

    def _take(self, nbytes: int) -> int:
        offset = -(-self._offset // _ALIGN) * _ALIGN
        if offset + nbytes > self._end:
            raise ArenaFull(f"a micro-batch's tensors take more than the {self._end - self._offset} bytes left of the "
                            "device arena's half: raise --device-arena-mb, or lower the micro-batch size")
        self._offset = offset + nbytes
        return offset


class _Reader(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, arena: mmap.mmap, copy: bool) -> None:
        super().__init__(file)
        self._arena = arena
        self._copy = copy

    def persistent_load(self, pid: Any) -> Any:
        kind, offset, dtype, shape = pid
        count = int(np.prod(shape)) if shape else 1
        if kind == "tensor":
            tensor = torch.frombuffer(self._arena, dtype=getattr(torch, dtype), count=count, offset=offset)
            tensor = tensor.view(shape)
            return tensor.clone() if self._copy else tensor
        array = np.frombuffer(self._arena, dtype=np.dtype(dtype), count=count, offset=offset).reshape(shape)
        return array.copy() if self._copy else array
