"""The shared memory between a worker and its device process: one arena per worker connection.

A worker's inference thread and the device process exchange one message per micro-batch, never one per request
(STYLE lesson 21). The message is small: the micro-batch's inputs pickled with each tensor (and numpy array)
replaced by where it lies in the arena, an anonymous shared file (``memfd``) that the worker makes and hands over
once, when it connects (``socket.send_fds``). The device process reads the inputs in place (views of the mapping:
no copy until the merge packs them into its batch) and writes the outputs to the arena's other half, which the
worker copies out before its next call reuses it. A call's cost here is per tensor, never per row: one view of the
arena's bytes made once (``Arena.bytes``) is sliced and viewed as each tensor's dtype and shape.

The arena dies with the last process that maps it: a killed worker or device process leaves nothing in
``/dev/shm``.
"""

from __future__ import annotations

import contextlib
import io
import math
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
        self.bytes: np.ndarray[Any, np.dtype[np.uint8]] | None = np.frombuffer(self._map, dtype=np.uint8)
        """The whole arena as bytes, viewed once: each tensor is a slice of it (None once closed)."""
        self.half = size // 2

    def write_inputs(self, value: Any) -> bytes:
        """``value`` as a small pickle, its tensors copied into the input half."""
        return self._write(value, 0)

    def write_outputs(self, value: Any) -> bytes:
        return self._write(value, self.half)

    def read_inputs(self, data: bytes) -> Any:
        """The inputs a worker wrote; their tensors are views of the arena, valid until the worker's next call."""
        return _Reader(io.BytesIO(data), self._view(), copy=False).load()

    def read_outputs(self, data: bytes) -> Any:
        """The outputs the device process wrote, copied out: the arena is reused by this thread's next call."""
        return _Reader(io.BytesIO(data), self._view(), copy=True).load()

    def close(self) -> None:
        # A view of it still referenced keeps the mapping alive (BufferError): it goes when that view does.
        self.bytes = None
        with contextlib.suppress(BufferError):
            self._map.close()
        os.close(self.fd)

    def _write(self, value: Any, start: int) -> bytes:
        out = io.BytesIO()
        writer = _Writer(out, self._view(), start, start + self.half)
        writer.dump(value)
        return out.getvalue()

    def _view(self) -> np.ndarray[Any, np.dtype[np.uint8]]:
        if self.bytes is None:
            raise ValueError("the arena is closed")
        return self.bytes


_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.complex64, torch.complex128)}
"""torch dtypes by the name a pickle of the arena carries."""
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


class _Writer(pickle.Pickler):
    """Pickles everything but tensors and arrays, which go into the arena from ``start`` on. ``reducer_override``
    rather than ``persistent_id``: pickle asks it only of objects that are not plain containers, numbers or
    strings, so a call costs a Python call per tensor, not per object."""

    def __init__(self, file: io.BytesIO, arena: np.ndarray[Any, np.dtype[np.uint8]], start: int, end: int) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._arena = arena
        self._offset = start
        self._end = end

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.numel():
            source = obj.detach()
            if source.device.type != "cpu":
                source = source.cpu()
            offset = self._take(source.numel() * source.element_size())
            # A uint8 view of the arena's bytes seen as the tensor's dtype: every dtype, bfloat16 included.
            target = torch.from_numpy(self._arena[offset : self._offset]).view(source.dtype)
            target.copy_(source.reshape(-1))
            name = _NAMES.get(source.dtype) or str(source.dtype).removeprefix("torch.")
            return _in_arena, ("tensor", offset, name, tuple(source.shape))
        if isinstance(obj, np.ndarray) and obj.dtype.kind in "biufc" and obj.size:
            offset = self._take(obj.nbytes)
            self._arena[offset : self._offset].view(obj.dtype).reshape(obj.shape)[...] = obj
            return _in_arena, ("array", offset, obj.dtype.str, obj.shape)
        return NotImplemented  # pickled as it is (an empty tensor too: nothing to share)

    def _take(self, nbytes: int) -> int:
        """The offset of ``nbytes`` more, aligned; the arena's next free byte is then its end."""
        offset = -(-self._offset // _ALIGN) * _ALIGN
        if offset + nbytes > self._end:
            raise ArenaFull(f"a micro-batch's tensors take more than the {self._end - self._offset} bytes left of the "
                            "device arena's half: raise --device-arena-mb, or lower the micro-batch size")
        self._offset = offset + nbytes
        return offset


def _in_arena(kind: str, offset: int, dtype: str, shape: tuple[int, ...]) -> Any:
    """What a pickle of the arena calls for each tensor or array: only ever resolved by ``_Reader``, to its own."""
    raise pickle.UnpicklingError("an arena's pickle is read by Arena.read_inputs or Arena.read_outputs")


class _Reader(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, arena: np.ndarray[Any, np.dtype[np.uint8]], copy: bool) -> None:
        super().__init__(file)
        self._arena = arena
        self._copy = copy

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name == _in_arena.__name__:
            return self._load
        return super().find_class(module, name)

    def _load(self, kind: str, offset: int, dtype: str, shape: tuple[int, ...]) -> Any:
        count = math.prod(shape)
        if kind == "tensor":
            torch_dtype = _DTYPES.get(dtype) or getattr(torch, dtype)
            view = self._arena[offset : offset + count * torch_dtype.itemsize]
            tensor = torch.from_numpy(view).view(torch_dtype).view(shape)
            return tensor.clone() if self._copy else tensor
        array_dtype = np.dtype(dtype)
        array = self._arena[offset : offset + count * array_dtype.itemsize].view(array_dtype).reshape(shape)
        return array.copy() if self._copy else array
