"""Handlers for the fault tests, loaded by ``kinference serve --handler tests.faults.handlers:TaggedEcho``."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from kinference.handlers.base import HandlerContext
from kinference.handlers.echo import EchoHandler


class TaggedEcho(EchoHandler):
    """Echo that says which process answered: each result is ``{"value": <request>, "pid": <pid>}``.

    With the reply's Kafka timestamp (when the reply was produced) this lets a test attribute every
    reply to one member and check it against that member's partition ownership.

    Options: ``delay_s`` sleeps that long per inference call (a model of bounded throughput, the GIL
    released); ``spin_s`` computes that long per inference call in Python (a CPU-bound model holding
    the GIL, so the service's other threads, the poll thread included, wait for their turn). A
    request ``{"stall_s": S, ...}`` makes the inference call of its micro-batch sleep S seconds more
    (one slow batch, e.g. longer than ``max.poll.interval.ms``).
    """

    name = "tagged-echo"

    def setup(self, context: HandlerContext) -> None:
        self._delay_s = float(context.options.get("delay_s", 0.0))
        self._spin_s = float(context.options.get("spin_s", 0.0))
        self._pid = os.getpid()

    def inference(self, inputs: list[Any]) -> list[Any]:
        stall_s = max((float(item.get("stall_s", 0)) for item in inputs if isinstance(item, dict)), default=0.0)
        if self._delay_s or stall_s:
            time.sleep(self._delay_s + stall_s)
        if self._spin_s:
            until = time.perf_counter() + self._spin_s
            while time.perf_counter() < until:
                pass
        return inputs

    def postprocess(self, outputs: list[Any], items: list[Any]) -> list[Any]:
        return [{"value": output, "pid": self._pid} for output in outputs]


class DeviceEcho(EchoHandler):
    """Echo run in a device process (``--device-process on``): each result is ``{"value": <request>, "device_pid":
    <the device process's pid>}``, so a test sees which device process answered. Its inputs cross the process
    boundary as plain data (pickled in the arena's message); ``merge`` joins the workers' micro-batches.

    Option ``delay_s``: each device batch sleeps that long (a model of bounded throughput)."""

    name = "device-echo"
    device_process = True

    def setup(self, context: HandlerContext) -> None:
        self._pid = os.getpid()
        self._delay_s = float(context.options.get("delay_s", 0.0))

    def merge(self, inputs: list[list[Any]]) -> list[Any]:
        return [item for batch in inputs for item in batch]

    def inference(self, inputs: list[Any]) -> list[Any]:
        if self._delay_s:
            time.sleep(self._delay_s)
        return [{"value": item, "device_pid": self._pid} for item in inputs]


class DeviceWedge(DeviceEcho):
    """``DeviceEcho`` whose device batch never returns when it holds a request ``{"wedge": true}``: a wedged model
    call, as a CUDA hang is."""

    name = "device-wedge"

    def inference(self, inputs: list[Any]) -> list[Any]:
        if any(isinstance(item, dict) and item.get("wedge") for item in inputs):
            threading.Event().wait()
        return super().inference(inputs)
