"""Handlers for the poison-input and shedding tests (``tests.faults.poison_handlers:Class``).

Both record what they computed, so a test can tell "answered with an error without being computed"
from "computed and then failed", and can see which requests shared a batch.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from kinference.errors import InvalidInput
from kinference.handlers.base import Handler, HandlerContext


class Recorder:
    """Thread-safe record of the batches a handler's stages saw (lists of items, in order)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.preprocessed: list[list[Any]] = []
        self.inferred: list[list[Any]] = []
        self.started = threading.Event()
        """Set when the first inference call starts."""

    def add(self, stage: list[list[Any]], items: list[Any]) -> None:
        with self._lock:
            stage.append(list(items))

    def seen(self) -> list[Any]:
        """Every item that reached inference (was computed), in order."""
        with self._lock:
            return [item for batch in self.inferred for item in batch]


class Poison(Handler):
    """Echo of ``{"n": <int>, ...}`` requests that misbehaves on command.

    ``validate`` rejects anything but an object with an integer ``"n"`` (``bad_request``, that request
    alone). A request's ``"poison"`` field picks the fault:

    - ``validate_crash``: ``validate`` raises ``ValueError`` (an unexpected error for one item);
    - ``cost_crash`` / ``cost_text``: ``cost`` raises, or returns ``"12"`` instead of a token count;
    - ``item_error``: ``postprocess`` puts an ``InvalidInput`` in that item's slot;
    - ``unserialisable``: its result holds an object orjson cannot encode;
    - ``deep``: its result is nested 300 levels deep (orjson encodes at most 254);
    - ``nan``, ``inf``, ``-inf``, ``np_nan``: its result holds that non-finite number;
    - ``preprocess_crash`` / ``batch_crash``: ``preprocess`` / ``inference`` raises for the micro-batch;
    - ``wrong_count``: ``postprocess`` returns one result fewer than the micro-batch has items;
    - ``not_a_list``: ``postprocess`` returns a dict instead of a list.

    ``{"sleep_s": S}`` makes the inference call of its micro-batch sleep S seconds.
    """

    name = "poison"

    def __init__(self) -> None:
        self.record = Recorder()

    def setup(self, context: HandlerContext) -> None:
        self.record = Recorder()

    def validate(self, payload: Any) -> Any:
        if not isinstance(payload, dict):
            raise InvalidInput(f"expected a JSON object, got {type(payload).__name__}")
        if "n" not in payload:
            raise InvalidInput('missing "n"')
        if isinstance(payload["n"], bool) or not isinstance(payload["n"], int):
            raise InvalidInput('"n" must be an integer')
        if payload.get("poison") == "validate_crash":
            raise ValueError("validate blew up on this item")
        return payload

    def cost(self, item: Any) -> Any:
        if item.get("poison") == "cost_crash":
            raise ValueError("cost blew up on this item")
        return "12" if item.get("poison") == "cost_text" else None

    def preprocess(self, items: list[Any]) -> list[Any]:
        self.record.add(self.record.preprocessed, items)
        if _any(items, "preprocess_crash"):
            raise RuntimeError("preprocess blew up on this micro-batch")
        return items

    def inference(self, inputs: list[Any]) -> list[Any]:
        self.record.add(self.record.inferred, inputs)
        self.record.started.set()
        time.sleep(max((float(item.get("sleep_s", 0)) for item in inputs), default=0.0))
        if _any(inputs, "batch_crash"):
            raise RuntimeError("inference blew up on this micro-batch")
        return inputs

    def postprocess(self, outputs: list[Any], items: list[Any]) -> Any:
        if _any(items, "wrong_count"):
            return [_result(output) for output in outputs[:-1]]
        if _any(items, "not_a_list"):
            return {"not": "a list"}
        return [_result(output) for output in outputs]


class SlowEcho(Handler):
    """Echo at a fixed cost per batch (handler option ``batch_s``, default 0.05 s): bounded throughput.

    Records every item it computed, so shed requests can be shown never to have reached the model.
    """

    name = "slow-echo-recording"

    def __init__(self) -> None:
        self.record = Recorder()
        self.batch_s = 0.05

    def setup(self, context: HandlerContext) -> None:
        self.record = Recorder()
        self.batch_s = float(context.options.get("batch_s", self.batch_s))

    def preprocess(self, items: list[Any]) -> list[Any]:
        return items

    def inference(self, inputs: list[Any]) -> list[Any]:
        self.record.add(self.record.inferred, inputs)
        self.record.started.set()
        extra = max((float(item.get("sleep_s", 0)) for item in inputs if isinstance(item, dict)), default=0.0)
        time.sleep(self.batch_s + extra)
        return inputs

    def postprocess(self, outputs: list[Any], items: list[Any]) -> list[Any]:
        return outputs


_NON_FINITE = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def _any(items: list[Any], poison: str) -> bool:
    return any(isinstance(item, dict) and item.get("poison") == poison for item in items)


def _result(item: dict) -> Any:
    poison = item.get("poison")
    if poison == "item_error":
        return InvalidInput(f"item {item['n']} rejected in postprocess")
    if poison == "unserialisable":
        return {"n": item["n"], "value": object()}
    if poison == "deep":
        nested: Any = item["n"]
        for _ in range(300):
            nested = [nested]
        return nested
    if poison in _NON_FINITE:
        return {"n": item["n"], "value": _NON_FINITE[poison]}
    if poison == "np_nan":
        import numpy as np  # transformers' dependency; only this poison needs it

        return {"n": item["n"], "value": np.array([1.0, np.nan], dtype=np.float32)}
    return item

