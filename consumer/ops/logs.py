"""Logging set-up: plain text or JSON lines. Message-related lines carry the request's coordinates."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import orjson

from kinference.consumer.ledger.request import Request

_REQUEST_FIELDS = ("topic", "partition", "offset", "correlation_id")


def about(request: Request) -> dict[str, Any]:
    """``extra=`` for a log call about one request: JSON logs show it as fields, text logs in the line."""
    return {"topic": request.topic, "partition": request.partition, "offset": request.offset,
            "correlation_id": request.correlation_id}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "thread": record.threadName,
            "message": record.getMessage(),
        }
        for field in _REQUEST_FIELDS:
            if hasattr(record, field):
                entry[field] = getattr(record, field)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(threadName)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        about = record.__dict__  # a request's coordinates ride in ``extra`` (``about``): attributes of this record only
        if "topic" in about:
            line += f" [{about['topic']}/{about['partition']}/{about['offset']} correlation {about['correlation_id']}]"
        return line


def setup_logging(level: str, log_format: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    formatter = JsonFormatter() if log_format == "json" else TextFormatter()
    formatter.converter = time.gmtime  # the "Z" above: timestamps are UTC
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
