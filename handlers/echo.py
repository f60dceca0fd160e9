"""The echo handler: returns each request value unchanged. No model: for tests and overhead benchmarks."""

from __future__ import annotations

from typing import Any

from kinference.handlers.base import Handler


class EchoHandler(Handler):
    name = "echo"

    def inference(self, inputs: list[Any]) -> list[Any]:
        return inputs
