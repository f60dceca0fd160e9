"""A generative handler for the engine-supervision tests, loaded by ``kinference serve --handler
tests.faults.generate_handlers:FaultyGenerate`` (apart from ``handlers.py``: it imports transformers' engine)."""

from __future__ import annotations

import threading
import time
from typing import Any

from kinference.handlers.base import HandlerContext
from kinference.handlers.generate import GenerateHandler


class FaultyGenerate(GenerateHandler):
    """The generate handler with engine faults on cue: a prompt with the word ``crash`` makes its prefill step raise
    (the engine's loop dies), one with ``wedge`` makes its step block until ``unwedge`` is set (a hung step; in a
    served process, for good). Option ``restart_delay_s``: each new engine after the first takes that much longer to
    build (as a large KV cache on a GPU does), so that the time the model is unhealthy can be seen from outside."""

    name = "faulty-generate"
    defaults: dict[str, Any] = {**GenerateHandler.defaults, "restart_delay_s": 0.0}

    def setup(self, context: HandlerContext) -> None:
        self.unwedge = threading.Event()
        self._restart_delay_s = float(context.options.get("restart_delay_s", 0.0))
        self._engines = 0
        super().setup(context)
        if context.role != "host":
            cues = {name: self.tokenizer.convert_tokens_to_ids(name) for name in ("crash", "wedge")}
            self._model.register_forward_pre_hook(lambda module, args, kwargs: self._on_cue(cues, kwargs),
                                                  with_kwargs=True)

    def _on_cue(self, cues: dict[str, int], kwargs: dict[str, Any]) -> None:
        input_ids = kwargs.get("input_ids")
        if input_ids is None:
            return
        if bool((input_ids == cues["crash"]).any()):
            raise RuntimeError("a crash on cue")
        if bool((input_ids == cues["wedge"]).any()):
            self.unwedge.wait()

    def _start_engine(self) -> Any:
        self._engines += 1
        if self._engines > 1:
            time.sleep(self._restart_delay_s)
        return super()._start_engine()
