"""Model handlers. ``load_handler`` resolves a built-in name or ``module:Class``."""

from __future__ import annotations

import importlib

from kinference.errors import HandlerLoadError
from kinference.handlers.base import Handler, HandlerContext

BUILTIN = {
    "echo": "kinference.handlers.echo:EchoHandler",
    "embedding": "kinference.handlers.embedding:EmbeddingHandler",
    "text-classification": "kinference.handlers.classification:TextClassificationHandler",
    "sim": "kinference.handlers.sim:SimulatedAccelerator",
    "image-classification": "kinference.handlers.image:ImageClassificationHandler",
    "torchserve": "kinference.handlers.torchserve:TorchServeHandler",
    "generate": "kinference.handlers.generate:GenerateHandler",
    "rerank": "kinference.handlers.rerank:RerankHandler",
    "sparse": "kinference.handlers.sparse:SparseHandler",
}

__all__ = ["BUILTIN", "Handler", "HandlerContext", "handler_class", "load_handler"]


def load_handler(spec: str) -> Handler:
    """Instantiate a handler from a built-in name or ``package.module:ClassName`` (not yet set up)."""
    return handler_class(spec)()


def handler_class(spec: str) -> type[Handler]:
    """The handler class a built-in name or ``package.module:ClassName`` names; importing its module."""
    target = BUILTIN.get(spec, spec)
    module_name, sep, class_name = target.partition(":")
    if not sep or not module_name or not class_name:
        raise HandlerLoadError(
            f"handler {spec!r} is neither a built-in ({', '.join(BUILTIN)}) nor 'module:Class'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise HandlerLoadError(f"cannot import handler module {module_name!r}: {exc}") from exc
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Handler)):
        raise HandlerLoadError(f"{target!r} is not a subclass of kinference.Handler")
    return cls
