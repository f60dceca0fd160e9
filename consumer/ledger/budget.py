"""The in-flight byte budget: what decoded requests hold in memory, bounded beside their count (``flow``).

A request count alone does not bound memory: 150 requests of a 959 KB array of two-character strings once took
the service's RSS from 61 MB to 2,188 MB (~14 MB each decoded), and the default count (2,048) would have allowed
~35 GB. So each request is charged what its value holds once decoded (``Request.held_bytes``, estimated from its
bytes by the decoder) from the poll thread's decode until the publisher takes its answer: by then the runner has let its
payload and item go (``path.stages``, after postprocess), and what remains of it (the raw value, the reply) is
bounded by the count. The budget writes no request: it keeps what it charged each one itself. Flow control pauses
the partitions once one more record would carry the budget past ``max_in_flight_bytes`` (``full``) and resumes
them at half, and the poll thread takes fewer records per poll as the budget fills (``records_allowed``), so that
one poll cannot overshoot it many times over.

Threads: the poll thread charges (and releases what a revoke discards), the publisher thread releases.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from kinference.consumer.ledger.request import Request

_MEAN_WEIGHT = 0.2
"""How much each poll moves the mean bytes per record that ``records_allowed`` plans with."""


class ByteBudget:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._held = 0
        self._charged: dict[Request, int] = {}
        """What each request in flight was charged: released once, whoever releases it again."""
        self._mean = 0.0
        """Bytes per record, a moving mean over the polls."""
        self._lock = threading.Lock()

    @classmethod
    def unbounded(cls) -> ByteBudget:
        """A budget that counts and never bounds."""
        return cls(max_bytes=2**63)

    @property
    def held(self) -> int:
        """Bytes charged and not yet released."""
        return self._held

    def charge(self, requests: list[Request]) -> None:
        """Count what one poll's requests hold. Poll thread."""
        if not requests:
            return
        sizes = self._charged
        charged = 0
        for request in requests:
            sizes[request] = size = request.held_bytes
            charged += size
        mean = charged / len(requests)
        # Up at once, down slowly: a burst of large requests after small ones is planned for from its first poll.
        self._mean = max(mean, self._mean + _MEAN_WEIGHT * (mean - self._mean))
        with self._lock:
            self._held += charged

    def release(self, requests: Iterable[Request]) -> None:
        """These requests no longer hold their decoded value (their runner let it go): count what they were charged
        released. A request is released once, whoever calls this again."""
        sizes = self._charged
        released = 0
        for request in requests:
            released += sizes.pop(request, 0)
        if released:
            with self._lock:
                self._held -= released

    @property
    def mean(self) -> float:
        """Bytes per record, as planned with: a moving mean over the polls that rises at once."""
        return self._mean

    def full(self) -> bool:
        """No room for one more record of the size seen (the moving mean): flow control pauses here, before the
        next poll takes one that would carry the budget past its bound. Never while nothing is held, so that a
        request larger than the whole budget is still served, alone."""
        held = self._held
        return held > 0 and held + self._mean > self.max_bytes

    def records_allowed(self, most: int) -> int:
        """How many records the next poll may take: ``most``, fewer as the budget fills (at the bytes per record seen
        so far: a moving mean that rises at once), and always at least one, so that a request larger than the whole
        budget is still served. The first poll takes one: nothing is known of the records yet. One poll can still
        overshoot when records grow past what was seen, by at most what librdkafka has prefetched
        (``queued.max.messages.kbytes``, 16 MiB by default) as it decodes."""
        if self._mean <= 0:
            return 1
        room = self.max_bytes - self._held
        return max(1, min(most, int(room / self._mean)))
