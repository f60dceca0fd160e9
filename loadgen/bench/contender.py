"""A Kafka contender (kinference, or a baseline loop) in a child process of its own.

``kinference bench`` and ``kinference drain`` measure contenders from this process; a contender running here
would share its GIL with the load generator's client (or the drain's watcher). So each one runs in a fresh
interpreter ("spawn") that gets only a picklable ``serve`` callable (a module-level function, or a
``functools.partial`` of one), the bootstrap servers and the topics, and builds the contender itself.

The child reports back over a pipe: ``ready`` once its consumer has partitions, ``stopped`` after it was told
to stop and shut down cleanly, or ``failed`` with its traceback. Each report is awaited with a timeout, and a
child that exits without one is an error too. With ``ready`` and ``stopped`` comes the contender's ``stats``:
its handler's (or loop's) ``stats()`` where it has one (the ``sim`` handler's busy time), and a kinference
service's time in inference calls.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import traceback
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event
from typing import Any

from kinference.errors import KinferenceError

log = logging.getLogger(__name__)

Topics = dict[str, str]
Serve = Callable[[str, Topics], AbstractContextManager[Any]]
"""``serve(bootstrap_servers, topics)``: runs the contender until the context exits. Must pickle."""

READY_TIMEOUT_S = 60.0
"""How long a contender may take to get its partitions once its consumer started."""
# Interpreter start, imports, model load and warm-up, then up to READY_TIMEOUT_S for the group to form.
_START_TIMEOUT_S = READY_TIMEOUT_S + 120.0
_STOP_TIMEOUT_S = 60.0  # a kinference Service drains for shutdown_grace_s, then flushes and closes
_KILL_TIMEOUT_S = 5.0
_STOP_POLL_S = 0.2


@dataclass
class Running:
    """A contender that reported ready: its process, and its stats then (and once stopped)."""

    pid: int
    ready: dict[str, Any]
    stopped: dict[str, Any] = field(default_factory=dict)


@contextmanager
def contender(name: str, serve: Serve, bootstrap_servers: str, topics: Topics) -> Iterator[Running]:
    """Run ``serve`` on ``topics`` in a child process named ``name`` until exit; KinferenceError when it fails
    or does not report in time. The child is joined on exit, and terminated (its own PID only) if it does not
    end in time."""
    spawn = multiprocessing.get_context("spawn")
    receive, send = spawn.Pipe(duplex=False)
    stop = spawn.Event()
    child = spawn.Process(target=_main, name=name, args=(serve, bootstrap_servers, topics, send, stop))
    child.start()
    send.close()  # the child now holds the only writing end: end of file on ``receive`` means it is gone
    try:
        running = Running(child.pid or 0, _expect("ready", child, receive, _START_TIMEOUT_S))
        yield running
        stop.set()
        running.stopped = _expect("stopped", child, receive, _STOP_TIMEOUT_S)
    finally:
        stop.set()
        _reap(child)
        receive.close()


def ready_or_fail(ready: bool, group: str) -> None:
    """For ``serve`` implementations: raise unless the consumer got its partitions in time."""
    if not ready:
        raise KinferenceError(f"consumer group {group} got no partitions within {READY_TIMEOUT_S:.0f} s")


def setup_logging() -> None:
    """Warnings and errors, named by process (the measuring one's or a contender's), and no progress bars: the
    same in every process of a run."""
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s")
    try:
        from transformers.utils import logging as transformers_logging
    except ImportError:  # a baseline-only install: nothing to silence
        return
    transformers_logging.disable_progress_bar()  # "Loading weights" bars would break the run's output


def _main(serve: Serve, bootstrap_servers: str, topics: Topics, report: Connection, stop: Event) -> None:
    """A contender process: serve until ``stop`` is set or the measuring process is gone."""
    setup_logging()
    parent = multiprocessing.parent_process()
    try:
        with serve(bootstrap_servers, topics) as served:
            report.send(("ready", _stats(served)))
            while not stop.wait(_STOP_POLL_S) and (parent is None or parent.is_alive()):
                pass
            stats = _stats(served)
    except BaseException:
        report.send(("failed", traceback.format_exc()))
        raise SystemExit(1) from None  # the measuring process shows the traceback, once
    report.send(("stopped", stats))


def _stats(served: Any) -> dict[str, Any]:
    """The handler's ``stats()`` (a kinference service's) or the loop's own, and a kinference service's seconds
    spent in inference calls (``inference_s``, summed over its inference threads)."""
    owner = getattr(served, "handler", served)
    stats = getattr(owner, "stats", None)
    figures = dict(stats()) if callable(stats) else {}
    registry = getattr(getattr(served, "metrics", None), "registry", None)
    if registry is not None:
        figures["inference_s"] = sum(sample.value for family in registry.collect()
                                     if family.name == "kinference_stage_seconds" for sample in family.samples
                                     if sample.name.endswith("_sum") and sample.labels.get("stage") == "inference")
    return figures


def _expect(word: str, child: BaseProcess, receive: Connection, timeout_s: float) -> dict[str, Any]:
    """Wait up to ``timeout_s`` for ``child`` to report ``word``; its stats, or KinferenceError with what happened
    instead."""
    what = f"{child.name} (pid {child.pid})"
    if not multiprocessing.connection.wait([receive, child.sentinel], timeout_s):
        raise KinferenceError(f"{what} did not report {word} within {timeout_s:.0f} s")
    try:
        said, detail = receive.recv()
    except EOFError:
        child.join(_KILL_TIMEOUT_S)
        raise KinferenceError(f"{what} exited with code {child.exitcode} before it reported {word}") from None
    if said != word:
        raise KinferenceError(f"{what} failed:\n{detail}")
    report: dict[str, Any] = detail
    return report


def _reap(child: BaseProcess) -> None:
    """Join ``child``; only if it has not ended in time, terminate it, then kill it."""
    child.join(_STOP_TIMEOUT_S)
    for end in (child.terminate, child.kill):
        if child.exitcode is not None:
            return
        log.warning("%s (pid %d) did not exit; sending %s", child.name, child.pid, end.__name__)
        end()
        child.join(_KILL_TIMEOUT_S)
