"""The machine a benchmark ran on, and the CPU time its processes spent (Linux /proc).

Every figure a benchmark reports is of this machine, so each report says what it is; CPU per message or image
is read from the processes themselves: the contender's, the broker's, the whole machine's.
"""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path
from typing import Any

from kinference.consumer.service import resolve_device


def machine() -> dict[str, Any]:
    import torch

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu": cpu, "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "device": resolve_device("auto")}


def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_tree_cpu_s(pid: int) -> float:
    """``process_cpu_s`` of ``pid`` and of every live process descending from it (a supervisor's workers)."""
    return sum(process_tree_cpu(pid).values())


def process_tree_cpu(pid: int) -> dict[int, float]:
    """``process_cpu_s`` of ``pid`` and of every live process descending from it, by process id."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # it ended meanwhile
        children.setdefault(parent, []).append(int(stat.parent.name))
    cpu, todo = {}, [pid]
    while todo:
        current = todo.pop()
        with contextlib.suppress(OSError):
            cpu[current] = process_cpu_s(current)
        todo += children.get(current, [])
    return cpu


def process_role(pid: int) -> str:
    """What a contender's process is, from its command line: ``device`` (a device process), ``worker``, or
    ``main`` (the contender's own process: a service, or a supervisor); ``gone`` once it has ended."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "gone"
    if b"--device-index" in argv:
        return "device"
    return "worker" if b"--worker-report" in argv else "main"


def machine_cpu_s() -> float:
    """CPU seconds every core of this machine has spent busy since boot (Linux /proc/stat): the broker, the load
    generator and the contender together."""
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")
