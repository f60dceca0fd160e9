"""Exceptions of the request-reply client. All derive from ``ClientError`` (a ``KinferenceError``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kinference.errors import KinferenceError

if TYPE_CHECKING:
    from kinference.loadgen.reply import Reply


class ClientError(KinferenceError):
    """The client could not get a reply for a request."""


class RequestTimeout(ClientError, TimeoutError):
    """No reply arrived within the request's timeout. A reply arriving later is counted and dropped."""


class TooManyPending(ClientError):
    """``max_pending`` requests were awaiting replies and none finished within the request's timeout."""


class DeliveryFailed(ClientError):
    """The broker did not accept the request record (e.g. the request topic does not exist)."""


class ClientClosed(ClientError):
    """The client was closed (or its reply reader failed) before the reply arrived."""


class ReplyError(ClientError):
    """The service answered with an error reply; ``code`` is one of ``kinference.ErrorCode``."""

    def __init__(self, code: str, message: str, reply: Reply) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.reply = reply
