"""``kinference serve --workers N``: N member processes of the consumer group on one host, and with a device
process one per GPU, under a small supervisor (gunicorn's arbiter, cut down to what a Kafka consumer needs).

- Each worker is a plain ``kinference serve`` of one process (the same flags, with ``--workers 1``): it joins the
  group, and Kafka's assignment spreads the partitions among the workers. Without a device process it loads its
  own copy of the model; with one (``device_process``), it hands its micro-batches to the device process of its GPU.
- The device processes start first (``kinference serve --device-index I``). The workers start once every device
  process is ready, and with ``--workers auto`` their number is what the device processes' calibrations say the
  devices can absorb, within the cores (``calibration``). A device process is supervised as a worker is.
- SIGTERM and SIGINT are forwarded to every worker, which shuts down as a single process does (within
  ``shutdown_grace_s``); a worker still running ``_KILL_MARGIN_S`` after that is killed.
- A device process that stops making progress (its report's ``progress``: a device batch running past
  ``--device-hang-s``, or no report at all for that long) is killed and replaced; it answered the calls of its hung
  batch with ``device_hung`` itself, and the workers send the others again to its replacement. ``/healthz`` names it
  from the moment it reports no progress until the replacement is ready.
- A worker is held to the same rule by its report alone: one whose report is older than ``worker_hang_limit``
  (``--device-hang-s``, at least ``WORKER_HANG_FLOOR_S``: the process is stopped, or a thread holds the GIL) is
  killed and started again; what it held is served again by the group (nothing was committed past it). Its hung
  micro-batches are the stages' watchdog's (``--handler-timeout-s``), and its engine's the engine's own.
- A worker that exits on its own is restarted, after a backoff that doubles with each quick death (from
  ``Restarts.backoff_s``). A worker that died ``Restarts.quick_deaths`` times in a row, each within
  ``Restarts.stable_s`` of its start, will not get better by itself: the supervisor stops the others and exits 1, so
  that the orchestrator sees it.
- One ``/metrics`` for the host: the workers' prometheus_client runs in multiprocess mode (each writes its
  metrics under ``PROMETHEUS_MULTIPROC_DIR``) and the supervisor's registry reads them with
  ``prometheus_client.multiprocess.MultiProcessCollector``. ``/healthz`` and ``/readyz`` are the supervisor's,
  from what each worker reports (``WorkerReport``: a small JSON file written every second); their answers name
  the worker that is unhealthy or not ready, and why.

The supervisor keeps no request state: a worker's requests are its own, and those a dead worker left uncommitted
are served again by the member that gets its partitions.

A supervisor that dies without its shutdown (SIGKILL, the OOM killer) takes its workers with it: each worker asks
the kernel for SIGTERM when its parent dies (``die_with_supervisor``), and shuts down as on any SIGTERM. Orphans
would go on serving as members of the group, beside the workers of a restarted supervisor. The temporary
directories it leaves are removed at the next supervisor's start (``remove_stale_dirs``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import orjson

log = logging.getLogger(__name__)

_TICK_S = 0.2


@dataclass(frozen=True)
class Restarts:
    """When a dead worker is started again, and when the supervisor gives up."""

    backoff_s: tuple[float, float] = (1.0, 30.0)
    """First and longest wait before a dead worker is started again."""
    stable_s: float = 60.0
    """A worker that ran this long before dying died of something passing: its backoff starts over."""
    quick_deaths: int = 5
    """Quick deaths in a row of one worker after which the supervisor gives up (exit 1)."""

_KILL_MARGIN_S = 5.0
"""After a forwarded signal, how long past ``shutdown_grace_s`` a worker may take before it is killed."""
_REPORT_S = 1.0
_JOINING_S = 0.05
_STALE_S = 10.0
"""A worker that has not reported for this long is hung (a stuck poll loop, a process stopped): unhealthy."""
WORKER_HANG_FLOOR_S = 20.0
"""A worker is killed for a silent report only past this, whatever ``--device-hang-s`` says: its report thread
shares the GIL with a loading model and a busy host, and a short device limit (seconds, in tests) must not kill a
worker that is merely slow to report."""
_CALIBRATION_METRICS = (
    ("batch_size", "batch_size", "Items per device batch, chosen at start (--device-batch-size auto)."),
    ("device_items_s", "device_items_per_second", "The device's items/s at that batch size, measured at start."),
    ("host_us_per_item", "host_us_per_item", "One worker's CPU µs per item, as estimated at start."),
    ("workers", "workers", "Workers this device can absorb, by the calibration."),
)
"""(Calibration attribute, metric name after kinference_calibration_, help)."""
WORKER_LOCAL_METRICS = frozenset({"kinference_ready", "kinference_healthy", "kinference_batch_cost_fixed_seconds",
                                  "kinference_batch_cost_per_unit_seconds"})
"""Gauges a worker computes when scraped, which multiprocess mode cannot share: the supervisor leaves them out of
the host's /metrics (and serves ready and healthy from its own view of the workers)."""


SUPERVISOR_PID = "KINFERENCE_SUPERVISOR_PID"
"""Set in each worker's environment: its supervisor's process id."""
_PR_SET_PDEATHSIG = 1
"""prctl(2): the signal the calling process gets when its parent dies."""
_WATCH_PARENT_S = 0.5
_DIR_PREFIXES = ("kinference-metrics-", "kinference-workers-")
"""The supervisor's temporary directories, each named ``<prefix><pid>-<random>`` after the supervisor's process."""


def die_with_supervisor() -> None:
    """A worker's first call: SIGTERM comes to it when its supervisor dies, however the supervisor dies (SIGKILL
    included), and the worker shuts down as on any SIGTERM. On Linux the kernel sends it (``PR_SET_PDEATHSIG``, which
    follows the supervisor's thread that started the worker: its run loop, which lives as long as the supervisor);
    elsewhere a thread watches the parent process id. Nothing outside a supervisor's worker."""
    expected = os.environ.get(SUPERVISOR_PID)
    if expected is None:
        return
    if sys.platform != "linux" or ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM)) != 0:
        threading.Thread(target=_watch_parent, args=(int(expected),), name="kinference-parent", daemon=True).start()
    elif os.getppid() != int(expected):  # it died before the kernel was asked
        os.kill(os.getpid(), signal.SIGTERM)


def _watch_parent(expected: int) -> None:
    while os.getppid() == expected:
        time.sleep(_WATCH_PARENT_S)
    log.critical("the supervisor (pid %d) is gone; stopping", expected)
    os.kill(os.getpid(), signal.SIGTERM)


def remove_stale_dirs(root: Path | None = None) -> list[Path]:
    """Remove the temporary directories that supervisors no longer running left in ``root`` (default: the system's
    temporary directory): a killed supervisor cannot remove its own. Returns those removed."""
    removed = []
    for prefix in _DIR_PREFIXES:
        for path in Path(root or tempfile.gettempdir()).glob(f"{prefix}*-*"):
            owner = path.name[len(prefix):].split("-", 1)[0]
            if owner.isdigit() and not _running(int(owner)):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    if removed:
        log.info("removed %d directories of supervisors no longer running: %s", len(removed),
                 ", ".join(str(path) for path in removed))
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


class WorkerReport:
    """A worker's side: writes what its ``/healthz`` and ``/readyz`` would answer to ``path`` for the supervisor, every
    second and at once when the worker joins the group (a drain times workers from then). ``with WorkerReport(path,
    service):`` around the service's whole life, its start included (a slow model load is "alive, not ready")."""

    def __init__(self, path: Path, service: Any, progress: Callable[[], dict[str, Any]] | None = None) -> None:
        """``progress``: what the supervisor replaces the process on (``Supervisor._stalled``)."""
        self._path = Path(path)
        self._service = service
        self._progress = progress
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kinference-worker-report", daemon=True)

    def __enter__(self) -> WorkerReport:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(_REPORT_S * 2)

    def _run(self) -> None:
        joined = False
        while True:
            self.write()
            # Often until the worker is in the group, so that its join is reported at once.
            self._wake.wait(_REPORT_S if joined else _JOINING_S)
            self._wake.clear()
            if self._stop.is_set():
                return
            joined = joined or self._service.wait_ready(0)

    def wake(self) -> None:
        """Write the report now, not at the next second (what the supervisor acts on changed)."""
        self._wake.set()

    def write(self) -> None:
        service = self._service
        report = {"pid": os.getpid(), "health": service.health_checks(), "ready": service.readiness_checks(),
                  "problems": service.problems()}
        if self._progress is not None:
            report["progress"] = self._progress()
        temporary = self._path.with_suffix(".tmp")
        temporary.write_bytes(orjson.dumps(report))
        os.replace(temporary, self._path)  # the supervisor never reads half a report


@dataclass(eq=False)
class Member:
    """One supervised process: a worker (a member of the consumer group) or a device process."""

    kind: Literal["worker", "device"]
    index: int
    report: Path
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    quick_deaths: int = 0
    restart_at: float | None = None
    last_exit: int | None = None
    restarts: int = 0
    replaced: str | None = None
    """Why it was killed for making no progress; cleared once its replacement is ready."""

    @property
    def name(self) -> str:
        return f"{self.kind} {self.index}"


def member_argv(member: Member, serve: list[str], devices: int, host_dir: Path) -> list[str]:
    """A supervised process's argv: ``serve`` (``kinference serve`` and the host's flags) with its role's. A worker
    serves as one process (``--workers 1``), with the socket of its device process (the workers are spread over
    ``devices``); a device process keeps the host's ``--workers`` (``auto`` asks it to calibrate for them)."""
    from kinference.consumer.accelerator.device_process import socket_path

    own = ["--worker-report", str(member.report)]
    if member.kind == "device":
        return [*serve, *own, "--device-index", str(member.index)]
    if devices:
        own += ["--device-socket", str(socket_path(host_dir, member.index % devices))]
    return [*serve, "--workers", "1", *own]


@dataclass(frozen=True)
class WorkerState:
    """What the supervisor knows of one worker now."""

    healthy: bool
    ready: bool
    why: str
    """Empty when healthy and ready."""


class Supervisor:
    """``Supervisor(n, command, ...).run()`` starts the processes and returns the exit code once they are stopped
    (``stop``, from a signal handler) or gave up."""

    def __init__(self, workers: int | None, command: Callable[[Member], list[str]], *, grace_s: float,
                 devices: int = 0, metrics_dir: Path | None = None, restarts: Restarts = Restarts()) -> None:
        """``command(member)`` is a worker's or a device process's argv. ``workers``: None sizes them from the
        ``devices`` device processes' calibrations. ``metrics_dir``: ``PROMETHEUS_MULTIPROC_DIR`` for the processes
        (emptied first; default: a temporary directory, removed at the end)."""
        self._command = command
        self._grace_s = grace_s
        self._restarts = restarts
        remove_stale_dirs()
        self._own_dir = metrics_dir is None
        self.metrics_dir = Path(metrics_dir or tempfile.mkdtemp(prefix=f"kinference-metrics-{os.getpid()}-"))
        self._reports = Path(tempfile.mkdtemp(prefix=f"kinference-workers-{os.getpid()}-"))
        self._env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(self.metrics_dir), SUPERVISOR_PID: str(os.getpid())}
        self.devices = [Member("device", index, self._reports / f"device-{index}.json") for index in range(devices)]
        self._worker_count = workers
        self.workers = [] if workers is None else [Member("worker", index, self._reports / f"worker-{index}.json")
                                                   for index in range(workers)]
        """The workers (with ``--workers auto``, once sized); they start once every device process is ready."""
        self._workers_started = False
        self._signal: int | None = None
        self._lock = threading.Lock()
        """Held while processes are started or reaped: the HTTP threads read their state."""

    @property
    def members(self) -> list[Member]:
        return [*self.devices, *self.workers]

    @property
    def host_dir(self) -> Path:
        """The directory the processes share (their reports, the device processes' sockets and calibrations, and
        the ``sim`` handler's device)."""
        return self._reports

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Forward ``signum`` to the processes and stop (safe from a signal handler: it only records it)."""
        self._signal = signum

    def run(self) -> int:
        self._clean_metrics_dir()
        try:
            for device in self.devices:
                self._spawn(device)
            while self._signal is None:
                if not self._workers_started:
                    self._start_workers()
                time.sleep(_TICK_S)
                if not self._tick(time.monotonic()):
                    self.stop()
                    self._shut_down()
                    return 1
            self._shut_down()
            return 0
        finally:
            shutil.rmtree(self._reports, ignore_errors=True)
            if self._own_dir:
                shutil.rmtree(self.metrics_dir, ignore_errors=True)

    def _start_workers(self) -> None:
        """Once every device process is ready: as many workers as asked, or as the calibrations say."""
        if not all(self._state(device, time.monotonic()).ready for device in self.devices):
            return
        if self._worker_count is None:
            sized = [Member("worker", index, self._reports / f"worker-{index}.json") for index in range(self._sized())]
            with self._lock:
                self.workers = sized
        self._workers_started = True
        for worker in self.workers:
            self._spawn(worker)

    def _sized(self) -> int:
        """``--workers auto``: what the device processes can absorb, together, within the host's cores."""
        from kinference.consumer.accelerator.calibration import Calibration, worker_cap
        from kinference.consumer.accelerator.device_process import calibration_path

        wanted = 0
        for device in self.devices:
            calibration = Calibration.read(calibration_path(self._reports, device.index))
            wanted += calibration.workers if calibration is not None else 1
        cap = worker_cap(len(self.devices))
        count = max(1, min(wanted, cap))
        log.info("workers: %d (the device processes can absorb %d; this host's cores allow %d beside %d device "
                 "processes)", count, wanted, cap, len(self.devices))
        return count

    # --- the host's /healthz, /readyz and /metrics (HTTP threads)

    def states(self) -> dict[str, WorkerState]:
        with self._lock:
            return {member.name: self._state(member, time.monotonic()) for member in self.members}

    def health_checks(self) -> dict[str, bool]:
        return {name: state.healthy for name, state in self.states().items()}

    def readiness_checks(self) -> dict[str, bool]:
        return {name: state.ready for name, state in self.states().items()}

    def problems(self) -> dict[str, str]:
        return {name: state.why for name, state in self.states().items() if state.why}

    def _state(self, worker: Member, now: float) -> WorkerState:
        if worker.replaced is not None:
            return WorkerState(False, False, f"replaced: {worker.replaced}")
        return self._reported(worker, now)

    def _reported(self, worker: Member, now: float) -> WorkerState:
        process = worker.process
        if process is None or process.poll() is not None:
            # The supervisor restarts it (or gives up and exits): not a reason to restart the whole host.
            return WorkerState(True, False, f"exited with code {worker.last_exit}; restarting")
        try:
            age = time.time() - worker.report.stat().st_mtime
            report = orjson.loads(worker.report.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            starting = now - worker.started < _STALE_S
            return WorkerState(starting, False, f"pid {process.pid}: " + ("starting" if starting else
                               f"no report for {now - worker.started:.0f} s"))
        if age > _STALE_S or report.get("pid") != process.pid:
            return WorkerState(False, False, f"pid {process.pid}: no report for {age:.0f} s (hung?)")
        healthy, ready = all(report["health"].values()), all(report["ready"].values())
        failing = [name for name, ok in {**report["health"], **report["ready"]}.items() if not ok]
        why = "" if healthy and ready else f"pid {process.pid}: " + "; ".join(failing + report["problems"])
        return WorkerState(healthy, ready, why)

    def collect(self) -> Iterable[Any]:
        """The host's metrics: the workers' (multiprocess mode) and the supervisor's own."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
        from prometheus_client.multiprocess import MultiProcessCollector

        from kinference.consumer.ops.metrics import build_info

        shared = MultiProcessCollector(None, path=str(self.metrics_dir))
        yield from (family for family in shared.collect() if family.name not in WORKER_LOCAL_METRICS)
        states = self.states()
        yield GaugeMetricFamily("kinference_ready", "1 while /readyz would answer 200 (every worker ready), else 0.",
                                value=float(all(state.ready for state in states.values())))
        yield GaugeMetricFamily("kinference_healthy", "1 while /healthz would answer 200 (no worker unhealthy), "
                                "else 0.", value=float(all(state.healthy for state in states.values())))
        up = GaugeMetricFamily("kinference_worker_up", "1 while the worker is healthy and ready.", labels=["worker"])
        restarts = CounterMetricFamily("kinference_worker_restarts", "Worker processes started again after they "
                                       "died.", labels=["worker"])
        device_up = GaugeMetricFamily("kinference_device_process_up", "1 while the device process is healthy and "
                                      "ready.", labels=["device"])
        device_restarts = CounterMetricFamily("kinference_device_process_restarts", "Device processes started "
                                              "again after they died.", labels=["device"])
        with self._lock:
            for member in self.members:
                state = states[member.name]
                gauge, counter = (up, restarts) if member.kind == "worker" else (device_up, device_restarts)
                gauge.add_metric([str(member.index)], float(state.healthy and state.ready))
                counter.add_metric([str(member.index)], member.restarts)
        yield from (up, restarts, device_up, device_restarts)
        yield from self._calibration_metrics()
        yield InfoMetricFamily("kinference_build", "Versions of kinference and of what it runs on.", value=build_info())

    # --- the supervisor's loop

    def _clean_metrics_dir(self) -> None:
        """prometheus_client's rule: the directory is emptied before the processes that write to it start."""
        self.metrics_dir.mkdir(parents=True, exist_ok=True)
        for stale in self.metrics_dir.glob("*.db"):
            stale.unlink()

    def _calibration_metrics(self) -> Iterable[Any]:
        """What each device process's calibration decided, and the worker count (``calibration``)."""
        from prometheus_client.core import GaugeMetricFamily

        from kinference.consumer.accelerator.calibration import Calibration
        from kinference.consumer.accelerator.device_process import calibration_path

        yield GaugeMetricFamily("kinference_workers", "Worker processes this host runs (--workers, or as sized at "
                                "start).", value=len(self.workers))
        families = {attribute: GaugeMetricFamily(f"kinference_calibration_{name}", about, labels=["device"])
                    for attribute, name, about in _CALIBRATION_METRICS}
        for device in self.devices:
            calibration = Calibration.read(calibration_path(self._reports, device.index))
            for attribute, family in families.items():
                if calibration is not None:
                    family.add_metric([str(device.index)], float(getattr(calibration, attribute)))
        yield from families.values()

    def _spawn(self, worker: Member) -> None:
        worker.report.unlink(missing_ok=True)
        with self._lock:
            worker.process = subprocess.Popen(self._command(worker), env=self._env)
            worker.started, worker.restart_at = time.monotonic(), None
        log.info("%s started (pid %d)", worker.name, worker.process.pid)

    def _tick(self, now: float) -> bool:
        """Reap dead processes and start due ones again; False once one died too often."""
        for worker in self.members:
            process = worker.process
            self._supervise_progress(worker, now)
            if worker.restart_at is not None:
                if now >= worker.restart_at:
                    worker.restarts += 1
                    self._spawn(worker)
                continue
            code = process.poll() if process is not None else None
            if process is None or code is None:
                continue
            self._reaped(worker, process)
            worker.quick_deaths = worker.quick_deaths + 1 if now - worker.started < self._restarts.stable_s else 1
            if worker.quick_deaths >= self._restarts.quick_deaths:
                log.critical("%s died %d times in a row within %.0f s of its start (last exit code %d); stopping "
                             "(exit code 1)", worker.name, worker.quick_deaths, self._restarts.stable_s, code)
                return False
            backoff = min(self._restarts.backoff_s[1], self._restarts.backoff_s[0] * 2 ** (worker.quick_deaths - 1))
            worker.restart_at = now + backoff
            log.error("%s (pid %d) exited with code %d; starting it again in %.1f s", worker.name, process.pid, code,
                      backoff)
        return True

    def _supervise_progress(self, member: Member, now: float) -> None:
        """Kill a running member that stopped making progress (it is then restarted as any dead one is); once its
        replacement is ready, it is healthy again."""
        process = member.process
        if process is None or process.poll() is not None:
            return
        if member.replaced is not None:
            if self._reported(member, now).ready:
                log.info("%s (pid %d) serves again after its replacement", member.name, process.pid)
                member.replaced = None
            return
        why = _stalled(member.report, process.pid)
        if why is not None:
            with self._lock:
                member.replaced = why
            log.error("%s (pid %d) makes no progress (%s); killing it to start it again", member.name, process.pid,
                      why)
            process.kill()

    def _reaped(self, worker: Member, process: subprocess.Popen[bytes]) -> None:
        """A worker's process ended: its live gauges leave the host's sums."""
        from prometheus_client import multiprocess

        worker.last_exit = process.returncode
        multiprocess.mark_process_dead(process.pid, str(self.metrics_dir))

    def _shut_down(self) -> None:
        signum = self._signal or signal.SIGTERM
        workers = [(worker, worker.process) for worker in self.workers
                   if worker.process is not None and worker.process.poll() is None]
        log.info("forwarding %s to %d workers", signal.Signals(signum).name, len(workers))
        self._stop_all(workers, signum)
        # The device processes last: the workers' last micro-batches still run there while they drain.
        devices = [(device, device.process) for device in self.devices
                   if device.process is not None and device.process.poll() is None]
        self._stop_all(devices, signum)

    def _stop_all(self, running: list[tuple[Member, subprocess.Popen[bytes]]], signum: int) -> None:
        for _, process in running:
            process.send_signal(signum)
        deadline = time.monotonic() + self._grace_s + _KILL_MARGIN_S
        for worker, process in running:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("%s (pid %d) did not stop in time; killing it", worker.name, process.pid)
                process.kill()
                process.wait()
            self._reaped(worker, process)


def worker_hang_limit(setting: float | str) -> dict[str, Any]:
    """A worker's ``progress`` in its report: no batch of its own to time, so only a limit on its report's age."""
    from kinference.consumer.config import hang_limit

    return {"limit_s": max(WORKER_HANG_FLOOR_S, hang_limit(setting)), "hung": None}


def _stalled(report_path: Path, pid: int) -> str | None:
    """Why the process ``pid`` that writes ``report_path`` makes no progress; None when it does, or does not report
    its progress. It says so itself (a device batch past its limit), or its report is older than the limit (the
    process is stopped, or stuck holding the GIL)."""
    try:
        age = time.time() - report_path.stat().st_mtime
        report = orjson.loads(report_path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
    progress = report.get("progress") or {}
    if report.get("pid") != pid or "limit_s" not in progress:
        return None
    if progress.get("hung"):
        return str(progress["hung"])
    if age > progress["limit_s"]:
        return f"no report for {age:.0f} s, past its limit ({progress['limit_s']:g} s, from --device-hang-s)"
    return None
