"""kinference's exception types. ``RequestError`` and ``InvalidInput`` are part of the handler contract."""

from __future__ import annotations

from kinference.protocol import ErrorCode


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

    Handlers raise ``InvalidInput`` (a subclass) from ``validate`` to reject one item without failing its
    neighbours in the batch, or put a ``RequestError`` in a result slot of ``postprocess``.
    """

    code: ErrorCode = ErrorCode.INTERNAL_ERROR

    def __init__(self, message: str, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self)


class ServiceFault(RequestError):
    """What runs a handler call failed, not the handler (a hung device process): the requests of that call fail
    with this error's own code, where a handler's exception gives ``handler_error``."""


class InvalidInput(RequestError):
    """One request's payload is not acceptable to the handler (reply code ``bad_request``)."""

    code = ErrorCode.BAD_REQUEST


class InputTooLong(InvalidInput):
    """A text has more tokens than the model takes, and is not to be cut (reply code ``input_too_long``)."""

    code = ErrorCode.INPUT_TOO_LONG
