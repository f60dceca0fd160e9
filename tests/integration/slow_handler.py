"""A custom handler loaded as ``module:Class`` by the tests: echo, 20 ms per batch."""

import time

from handlers.echo import EchoHandler


class SlowEcho(EchoHandler):
    name = "slow-echo"

    def inference(self, inputs):
        time.sleep(0.02)
        return inputs
