"""kinference's request-reply client and load generator.

- ``client``   ``Client``: send requests, get futures / awaitables of their ``Reply``,
- ``pending``  the bounded table of requests awaiting replies (deadlines, late and duplicate replies),
- ``corpus``   request payloads (built-in text corpus or a JSON-lines file),
- ``runner``   closed- and open-loop load and concurrency sweeps on one event loop,
- ``report``   per-request samples -> the JSON report; ``tables`` and ``plot`` show it,
- ``cli``      ``kinference loadgen``; ``demo`` the one-command demo (``kinference demo``).
- ``bench``    the benchmarks that drive it (``kinference bench``, ``drain``, ``cpu-paths``), a subpackage.
"""

from kinference.loadgen.client import Client
from kinference.loadgen.errors import (
    ClientClosed,
    ClientError,
    DeliveryFailed,
    ReplyError,
    RequestTimeout,
    TooManyPending,
)
from kinference.loadgen.pending import ClientStats
from kinference.loadgen.reply import Reply

__all__ = [
    "Client",
    "ClientClosed",
    "ClientError",
    "ClientStats",
    "DeliveryFailed",
    "Reply",
    "ReplyError",
    "RequestTimeout",
    "TooManyPending",
]
