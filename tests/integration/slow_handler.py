"""A custom handler loaded as ``module:Class`` by the tests: echo, 20 ms per batch."""

import time

from kinference.errors import InvalidInput
from kinference.handlers.echo import EchoHandler


class SlowEcho(EchoHandler):
    name = "slow-echo"

    def inference(self, inputs):
        time.sleep(0.02)
        return inputs


class RejectNull(EchoHandler):
    """Echo, but a JSON ``null`` request is rejected with ``bad_request`` (an error reply per request)."""

    name = "reject-null"

    def validate(self, payload):
        if payload is None:
            raise InvalidInput("null is not a request")
        return payload


class SlowLength(EchoHandler):
    """Each request's JSON length, 300 ms per batch: large requests wait in flight, and the replies stay small."""

    name = "slow-length"

    def inference(self, inputs):
        time.sleep(0.3)
        return [len(item) if isinstance(item, list | dict | str) else 0 for item in inputs]
