"""kinference: Kafka-native streaming inference.

The public API::

    from kinference import Handler, HandlerContext, InvalidInput   # write a handler
    from kinference import Client, Reply, ReplyError               # send requests, read replies

The handler contract (``Handler``, ``HandlerContext``, the errors) imports nothing but the standard library
and ``kinference.protocol``; the client needs confluent-kafka and orjson only, which is all that a plain
``pip install kinference`` brings. The service itself is ``kinference.consumer`` (``pip install
'kinference[serve]'``); the model handlers are ``kinference.handlers``, the client and the load generator
``kinference.loadgen``. The import package maps the repository's top-level folders (see pyproject.toml).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kinference.errors import HandlerLoadError, InvalidInput, KinferenceError, RequestError
from kinference.handlers.base import Handler, HandlerContext
from kinference.protocol import ErrorCode

if TYPE_CHECKING:
    from kinference.loadgen.client import Client
    from kinference.loadgen.errors import ClientError, ReplyError, RequestTimeout
    from kinference.loadgen.reply import Reply

__version__ = "0.2.0"

# The client is imported on first use, so that a handler module importing the contract does not load the
# Kafka client library too.
_CLIENT_API = {
    "Client": "kinference.loadgen.client",
    "ClientError": "kinference.loadgen.errors",
    "Reply": "kinference.loadgen.reply",
    "ReplyError": "kinference.loadgen.errors",
    "RequestTimeout": "kinference.loadgen.errors",
}

__all__ = [
    "Client",
    "ClientError",
    "ErrorCode",
    "Handler",
    "HandlerContext",
    "HandlerLoadError",
    "InvalidInput",
    "KinferenceError",
    "Reply",
    "ReplyError",
    "RequestError",
    "RequestTimeout",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name in _CLIENT_API:
        import importlib

        return getattr(importlib.import_module(_CLIENT_API[name]), name)
    raise AttributeError(f"module 'kinference' has no attribute {name!r}")
