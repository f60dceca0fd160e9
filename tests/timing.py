"""Comparing the cost of two calls on a shared, noisy machine: a ratio of their fastest runs, taken in turns, so
that a busy moment slows both."""

from __future__ import annotations

import time
from collections.abc import Callable


def cost_ratio(call: Callable[[], object], baseline: Callable[[], object], rounds: int = 11) -> float:
    """The fastest of ``rounds`` runs of ``call`` over the fastest of ``baseline``'s, run in turns."""
    fastest = [float("inf"), float("inf")]
    for _ in range(rounds):
        for i, run in enumerate((call, baseline)):
            start = time.perf_counter()
            run()
            fastest[i] = min(fastest[i], time.perf_counter() - start)
    return fastest[0] / fastest[1]
