"""How busy a GPU was while a benchmark ran: NVML's utilisation, sampled in a thread.

NVML's ``utilization.gpu`` is the share of its last sample period (1/6 s to 1 s, by product) in which at least
one kernel ran on the GPU: what ``nvidia-smi`` shows. Sampled every ``interval_s`` over a measurement and
averaged, it is the measurement's busy fraction. It says the GPU was in use, not how much of its compute was
(a launch-bound model can read 90% busy at a tenth of the peak FLOPs).

NVML comes with the NVIDIA driver; its Python binding is the ``nvidia-ml-py`` package (``import pynvml``,
``pip install 'kinference[gpu]'``). Without a CUDA device, or without the binding, a ``BusySampler`` measures
nothing and says why: the benchmarks leave their busy column empty.
"""

from __future__ import annotations

import os
import threading
from types import TracebackType
from typing import Any

_INTERVAL_S = 0.1


class BusySampler:
    """``with BusySampler(device) as busy:`` ... ``busy.fraction()``: the mean NVML utilisation of ``device``'s GPU
    while the ``with`` ran, or None (``busy.note`` says why) where there is none to read."""

    def __init__(self, device: str, interval_s: float = _INTERVAL_S) -> None:
        self.device = device
        self.interval_s = interval_s
        self.note = ""
        self._samples: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml: Any = None

    def __enter__(self) -> BusySampler:
        if not self.device.startswith("cuda"):
            self.note = f"no GPU: {self.device}"
            return self
        try:
            import pynvml
        except ImportError:
            self.note = "nvidia-ml-py is not installed (pip install 'kinference[gpu]')"
            return self
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            self.note = f"NVML cannot start: {exc}"
            return self
        self._nvml = pynvml
        handle = pynvml.nvmlDeviceGetHandleByIndex(nvml_index(self.device))
        self._thread = threading.Thread(target=self._sample, args=(handle,), name="gpu-busy", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5 * self.interval_s + 1)
            self._nvml.nvmlShutdown()

    def fraction(self) -> float | None:
        """The mean utilisation over the samples, 0 to 1; None without samples."""
        if not self._samples:
            if self._thread is not None and not self.note:
                self.note = "no NVML sample"
            return None
        return round(sum(self._samples) / len(self._samples) / 100, 3)

    def _sample(self, handle: Any) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._samples.append(self._nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except self._nvml.NVMLError as exc:  # a GPU lost meanwhile: keep what was read, and say so
                self.note = f"NVML stopped answering: {exc}"
                return


def nvml_index(device: str) -> int:
    """NVML's index of torch's ``device`` (``cuda``, ``cuda:1``): NVML counts every GPU of the host, torch only
    those in ``CUDA_VISIBLE_DEVICES``, in its order."""
    torch_index = int(device.partition(":")[2] or 0)
    visible = [entry.strip() for entry in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if entry.strip()]
    if torch_index < len(visible) and visible[torch_index].isdigit():
        return int(visible[torch_index])
    return torch_index
