"""Live figures while a run is going: rolling throughput and p99, shown in a rich progress bar."""

from __future__ import annotations

from collections import deque
from types import TracebackType

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

_WINDOW_S = 3.0
LINE_WIDTH = 75
"""The progress line's width with five-digit counts and a p99 of seconds: within the 76 columns where the demo's
line was cut."""


class LiveStats:
    """Counts since the run began, and throughput and p99 over the last few seconds."""

    def __init__(self, window_s: float = _WINDOW_S) -> None:
        self.window_s = window_s
        self.sent = 0
        self.answered = 0
        self.lost = 0
        self._recent: deque[tuple[float, float]] = deque()

    def on_sent(self) -> None:
        self.sent += 1

    def on_done(self, now: float, latency_ms: float | None) -> None:
        """A request finished at ``now``: answered with ``latency_ms``, or lost when it is None."""
        if latency_ms is None:
            self.lost += 1
            return
        self.answered += 1
        self._recent.append((now, latency_ms))

    def rolling(self, now: float) -> tuple[float, float | None]:
        """(replies per second, p99 latency in ms) over the window ending at ``now``."""
        while self._recent and self._recent[0][0] < now - self.window_s:
            self._recent.popleft()
        if not self._recent:
            return 0.0, None
        latencies = np.fromiter((latency for _, latency in self._recent), dtype=float)
        return len(self._recent) / self.window_s, float(np.percentile(latencies, 99, method="inverted_cdf"))


class ProgressView:
    """One progress line per run (a sweep keeps the finished lines on screen)."""

    def __init__(self, console: Console | None = None, enabled: bool = True) -> None:
        # Within LINE_WIDTH columns, elapsed time included: wider, rich cuts the line's end on a narrow terminal
        # (a demo showed `0:00:…` at 76). A count past its width widens the line instead of losing digits.
        self._progress = Progress(
            TextColumn("[bold]{task.description:<7}"),
            BarColumn(bar_width=6),
            TextColumn("sent {task.fields[sent]:>5} replies {task.fields[answered]:>5} lost {task.fields[lost]:>2} "
                       "{task.fields[rps]:>4.0f}/s p99 {task.fields[p99]:>6}ms"),
            TimeElapsedColumn(),
            console=console,
            disable=not enabled,
        )
        self._task: TaskID | None = None

    def __enter__(self) -> ProgressView:
        self._progress.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._progress.stop()

    def begin(self, description: str, total: float) -> None:
        self._task = self._progress.add_task(description, total=total, sent=0, answered=0, lost=0,
                                             rps=0.0, p99="-")

    def update(self, live: LiveStats, now: float, completed: float, description: str | None = None) -> None:
        assert self._task is not None, "begin() first"
        rps, p99 = live.rolling(now)
        # rich leaves the description as it is for None.
        self._progress.update(self._task, completed=completed, description=description or None, sent=live.sent,
                              answered=live.answered, lost=live.lost, rps=rps, p99="-" if p99 is None else f"{p99:.1f}")
