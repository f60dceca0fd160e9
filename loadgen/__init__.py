"""kinfer's request-reply client and load generator.

- ``client``   ``KinferClient``: send requests, get futures / awaitables of their ``Reply``,
- ``pending``  the bounded table of requests awaiting replies (deadlines, late and duplicate replies),
- ``corpus``   request payloads (built-in text corpus or a JSON-lines file),
- ``runner``   closed- and open-loop load and concurrency sweeps on one event loop,
- ``report``   per-request samples -> the JSON report; ``tables`` and ``plot`` show it,
- ``cli``      ``kinfer loadgen``; ``demo`` the one-command demo (``kinfer demo``).
"""

from loadgen.client import KinferClient
from loadgen.errors import ClientClosed, ClientError, DeliveryFailed, ReplyError, RequestTimeout, TooManyPending
from loadgen.pending import ClientStats
from loadgen.reply import Reply

__all__ = [
    "ClientClosed",
    "ClientError",
    "ClientStats",
    "DeliveryFailed",
    "KinferClient",
    "Reply",
    "ReplyError",
    "RequestTimeout",
    "TooManyPending",
]
