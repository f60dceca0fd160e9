"""The device process's life: load every model that can run here, warm it up, calibrate, serve (``device_server``).

Started by the supervisor as ``kinference serve ... --device-index I`` (the user's own flags), before the
workers: they connect to its socket in the host directory (``socket_path``), and the supervisor sizes
``--workers auto`` from its calibration (``calibration_path``). Its health and readiness go to the supervisor as a
worker's do (``WorkerReport``), so ``/healthz`` names it when it fails; a dead device process is restarted, and
its workers send their calls again (``worker_link``). Its report carries its progress too (``progress``): a device
batch running past ``--device-hang-s`` gets the process replaced (``supervisor``).

On SIGTERM it serves on until its workers have closed their connections (``DeviceServer.drain``): a SIGTERM to the
whole process group (systemd's ``KillMode=control-group``) reaches the workers and this process at once, and the
workers' last micro-batches still need it while they drain.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY

from kinference.consumer.accelerator.calibration import Calibration, calibrate
from kinference.consumer.accelerator.device_engine import DeviceEngine
from kinference.consumer.accelerator.device_server import DeviceBatching, DeviceMetrics, DeviceServer
from kinference.consumer.config import ServiceConfig, hang_limit, served_name
from kinference.errors import ConfigError
from kinference.handlers import Handler, HandlerContext, load_handler
from kinference.handlers.generative import GenerativeHandler

log = logging.getLogger(__name__)

DEFAULT_DEVICE_BATCH_SIZE = 256
"""``--device-batch-size auto`` without a calibration (a handler with no calibration payloads): the largest
batch the calibration would try."""
def socket_path(host_dir: Path, index: int) -> Path:
    return host_dir / f"device-{index}.sock"


def calibration_path(host_dir: Path, index: int) -> Path:
    return host_dir / f"device-{index}.calibration.json"


def torch_device(spec: str, index: int) -> str:
    """The torch device of device process ``index``: with ``cuda``, one per GPU, its own; a named one (``cuda:1``,
    ``cpu``) as given (there is one device process then)."""
    return f"cuda:{index}" if spec == "cuda" else spec


class DeviceProcess:
    """``DeviceProcess(config, index, host_dir).start()`` loads, warms up, calibrates and serves; ``stop()``."""

    def __init__(self, config: ServiceConfig, index: int, host_dir: Path, device: str) -> None:
        self._config = config
        self._index = index
        self._host_dir = Path(host_dir)
        self._device = torch_device(device, index)
        self._max_rows = (DEFAULT_DEVICE_BATCH_SIZE if config.device_batch_size == "auto"
                          else int(config.device_batch_size))
        self._handlers: dict[str, Handler] = {}
        """The models whose batches run here (``merge`` + ``inference``)."""
        self._engines: dict[str, DeviceEngine] = {}
        """The generative models' engines (``device_engine``)."""
        self._server: DeviceServer | None = None
        self._ready = threading.Event()

    def start(self, on_hung: Callable[[], None] | None = None) -> DeviceProcess:
        """``on_hung``: called once this process has hung (its report is then written at once)."""
        if self._config.torch_threads is not None:
            import torch

            torch.set_num_threads(self._config.torch_threads)
        for name, handler in self._load():
            handler.warm_up()
            if isinstance(handler, GenerativeHandler):
                self._engines[name] = DeviceEngine(name, handler)
            else:
                self._handlers[name] = handler
        if not self._handlers and not self._engines:
            raise ConfigError("no model of this service can run in a device process: use --device-process off")
        calibration = self._calibrate()
        batching = DeviceBatching(calibration.batch_size, threads=self._config.device_threads,
                                  hang_s=hang_limit(self._config.device_hang_s, calibration.slowest_batch_s()))
        self._server = DeviceServer(self._handlers, socket_path(self._host_dir, self._index), batching,
                                    DeviceMetrics(self._index, REGISTRY), self._engines, on_hung).start()
        self._ready.set()
        log.info("device process %d serving %s on %s (device batches of up to %d items, %d threads; hung past "
                 "%.1f s)", self._index, ", ".join([*self._handlers, *self._engines]), self._device,
                 calibration.batch_size, batching.threads, batching.hang_s)
        return self

    def _load(self) -> list[tuple[str, Handler]]:
        """Each model whose handler can run here (the others run in every worker), set up on this device."""
        loaded = []
        for settings in self._config.model_configs():
            handler = load_handler(settings.handler)
            if not handler.device_process:
                continue
            handler.setup(HandlerContext(device=self._device, model=settings.model,
                                         options=dict(settings.handler_options), max_batch_size=self._max_rows,
                                         registry=REGISTRY, host_dir=self._host_dir, role="device",
                                         hang_s=hang_limit(settings.device_hang_s)))
            loaded.append((served_name(settings, handler), handler))
        return loaded

    def _calibrate(self) -> Calibration:
        """The device batch size: measured when ``auto`` or when the supervisor sizes the workers; written for it."""
        config = self._config
        fixed = None if config.device_batch_size == "auto" else int(config.device_batch_size)
        if fixed is not None and config.workers != "auto":
            return Calibration(fixed, 0.0, 0.0, 1, {})
        name, handler = next(iter(self._handlers.items()), (None, None))
        result = None if handler is None else calibrate(handler, self._max_rows, fixed)
        if result is None:  # a generative engine batches per decoding step: nothing to calibrate
            log.info("calibration: model %s has no calibration payloads; device batches of up to %d items",
                     name or ", ".join(self._engines), self._max_rows)
            result = Calibration(self._max_rows, 0.0, 0.0, 1, {})
        else:
            log.info("device %d %s", self._index, result.line())
        result.write(calibration_path(self._host_dir, self._index))
        return result

    # --- what WorkerReport tells the supervisor

    def wait_ready(self, timeout_s: float) -> bool:
        return self._ready.wait(timeout_s)

    def health_checks(self) -> dict[str, bool]:
        """The server's threads, its progress, and each generative model's engine (red while it is replaced)."""
        return {"device server": self.healthy, "progress": self._server is None or self._server.hung is None,
                **{f"model {name}": engine.handler.health.problem is None for name, engine in self._engines.items()}}

    def readiness_checks(self) -> dict[str, bool]:
        return {"model_loaded": self._ready.is_set()}

    def problems(self) -> list[str]:
        engines = [problem for engine in self._engines.values() if (problem := engine.handler.health.problem)]
        if self._server is None:
            return engines
        return [*self._server.crashed, *([self._server.hung] if self._server.hung is not None else []), *engines]

    def progress(self) -> dict[str, Any]:
        """For the supervisor (``WorkerReport``): how long the oldest device batch has run, the limit, and why this
        process is hung (None while it makes progress)."""
        server = self._server
        if server is None:
            return {}
        return {"limit_s": server.hang_s, "stalled_s": server.stalled_s(), "hung": server.hung}

    @property
    def healthy(self) -> bool:
        """Its threads run (a hung one is the supervisor's to replace: ``progress``)."""
        return self._server is None or self._server.alive

    @property
    def failed(self) -> bool:
        """Unhealthy for good: red for another reason than an engine that is being replaced here."""
        replacing = {f"model {name}" for name, engine in self._engines.items() if engine.handler.health.replacing}
        return not all(ok or name in replacing for name, ok in self.health_checks().items())

    def stop(self, timeout_s: float) -> None:
        """Once every worker has gone (their drain needs this process: a SIGTERM to the process group reaches both
        at once), stop serving. A hung process does not wait: its supervisor replaces it."""
        if self._server is not None:
            if self._server.hung is None and not self._server.drain(timeout_s):
                log.warning("stop: workers still connected after %.0f s", timeout_s)
            self._server.stop(timeout_s)
        for handler in [*self._handlers.values(), *(engine.handler for engine in self._engines.values())]:
            handler.close()
