"""What the ``adaptive`` batching policy learns while the service runs: how fast requests arrive, and
what a batch costs.

A batch costs ``t = a + b * x`` seconds, ``x`` being its padded tokens (longest x count) for handlers
that count tokens, else its request count. ``a`` is the price of running a batch at all (kernel
launches, Python, the copy to the device); ``b`` the price of each unit of work in it. Both are fitted
by least squares over recent batches, recent ones weighing more, so the model follows the load and the
machine.

The policy's rule follows from that model. An idle model that runs the ``n`` waiting requests now
serves them at ``n / t(n)``; waiting ``w`` seconds for the ``lambda * w`` more that arrive meanwhile
gives ``(n + lambda * w) / (w + t(n + lambda * w))``. The second is larger exactly when
``n < lambda * a``: waiting pays only while fewer requests wait than arrive during one batch's fixed
cost. At low load (``lambda * a < 1``) a lone request is dispatched at once; where batches are nearly
free to grow (a GPU), the policy waits for the batch the arrival rate can fill.
"""

from __future__ import annotations

import math


class ArrivalRate:
    """Requests per second over roughly the last ``window_s``: a count that decays exponentially.

    For arrivals at a steady rate ``r`` the decayed count settles at ``r * window_s``.
    """

    def __init__(self, window_s: float = 1.0) -> None:
        self._window_s = window_s
        self._count = 0.0
        self._last: float | None = None

    def add(self, now: float, n: int = 1) -> None:
        self._count = self._decayed(now) + n
        self._last = now

    def per_s(self, now: float) -> float:
        return self._decayed(now) / self._window_s

    def _decayed(self, now: float) -> float:
        if self._last is None:
            return 0.0
        return self._count * math.exp(-max(0.0, now - self._last) / self._window_s)


class BatchCost:
    """Least-squares fit of ``seconds = a + b * work`` over recent batches (each older one weighs
    ``forget`` times less)."""

    def __init__(self, forget: float = 0.98, min_batches: int = 8) -> None:
        self._forget = forget
        self._min_batches = min_batches
        self._batches = 0
        self._w = self._x = self._xx = self._y = self._xy = 0.0

    def observe(self, work: float, seconds: float) -> None:
        f = self._forget
        self._w = self._w * f + 1
        self._x = self._x * f + work
        self._xx = self._xx * f + work * work
        self._y = self._y * f + seconds
        self._xy = self._xy * f + work * seconds
        self._batches += 1

    def fit(self) -> tuple[float, float] | None:
        """``(a, b)`` in seconds and seconds per unit of work; None until enough batches of different
        sizes were seen (batches all of one size say nothing about the fixed cost)."""
        if self._batches < self._min_batches:
            return None
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var_x = self._xx / self._w - mean_x * mean_x
        if var_x <= (0.1 * mean_x) ** 2:
            return None
        b = (self._xy / self._w - mean_x * mean_y) / var_x
        if b <= 0:  # cost does not grow with size (noise, or an accelerator far from full): all of it is fixed
            return mean_y, 0.0
        a = mean_y - b * mean_x
        return max(a, 0.0), b

    def seconds(self, work: float) -> float | None:
        """Predicted cost of a batch of ``work``; None while the model knows nothing."""
        fitted = self.fit()
        return None if fitted is None else fitted[0] + fitted[1] * work
