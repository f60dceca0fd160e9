"""kinference's exception types and the stable error codes carried in error replies."""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    """Codes of the ``{"error": {"code": ...}}`` reply. Clients may switch on them: never rename."""

    BAD_REQUEST = "bad_request"
    """The record is not a valid request: undecodable value or headers, or rejected by the handler."""
    PAYLOAD_TOO_LARGE = "payload_too_large"
    """The record value is larger than ``max_request_bytes``, or its headers than ``max_header_bytes``."""
    DEADLINE_EXCEEDED = "deadline_exceeded"
    """The ``kinference-deadline-ms`` deadline passed before the request was computed."""
    OVERLOADED = "overloaded"
    """Shed unanswered: the request was older than ``max_queue_ms`` when the service got to it."""
    HANDLER_ERROR = "handler_error"
    """The handler raised, or returned outputs that do not match its inputs."""
    INTERNAL_ERROR = "internal_error"
    """A fault in kinference itself; the message says what failed."""


class KinferenceError(Exception):
    """Base of kinference's exceptions."""


class ConfigError(KinferenceError):
    """The configuration is invalid; the message says what to change."""


class HandlerLoadError(KinferenceError):
    """A handler could not be found, imported or set up."""


class BrokerError(KinferenceError):
    """The embedded broker could not be started or did not answer."""


class RequestError(KinferenceError):
    """A single request failed; carries the code its error reply gets.

    Handlers raise ``InvalidInput`` (a subclass) from ``validate`` to reject one item
    without failing its neighbours in the batch.
    """

    code: ErrorCode = ErrorCode.INTERNAL_ERROR

    def __init__(self, message: str, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self)


class InvalidInput(RequestError):
    """One request's payload is not acceptable to the handler (reply code ``bad_request``)."""

    code = ErrorCode.BAD_REQUEST
