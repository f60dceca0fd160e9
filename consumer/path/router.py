"""Routing: which of the process's models serves a record, read in the poll thread before its value is decoded
(the model's handler says how: JSON, bytes or a record; Open Inference Protocol or not).

A record is for, in this order:

1. the model its headers name: ``kinference-model`` (and ``kinference-model-version``), else MLServer's
   ``mlserver-model`` (and ``mlserver-version``): kinference's header wins where both are set
   (``oip.named_model``). A name or version this process does not serve is the request's ``model_not_found``,
   never another model's guess;
2. else the model its request topic is mapped to (``models[].request_topics``);
3. else the default model: the first one configured.

One model (the default configuration) routes every record to itself; its name still goes on replies and metrics.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kinference.consumer.wire import oip
from kinference.errors import RequestError
from kinference.protocol import MODEL, MODEL_VERSION, ErrorCode, PayloadFormat


@dataclass(frozen=True, slots=True)
class ModelRoute:
    """One served model, as routing and decoding see it."""

    name: str
    version: str | None
    payload_format: PayloadFormat
    served: oip.ServedModel | None = None
    """What Open Inference Protocol requests to this model may name; None: it takes kinference's JSON only."""

    reply_headers: tuple[tuple[str, bytes], ...] = field(init=False, repr=False, compare=False)
    """The headers naming this model on each of its replies: built once, here, not per reply."""

    def __post_init__(self) -> None:
        headers: tuple[tuple[str, bytes], ...] = ((MODEL, self.name.encode()),)
        if self.version is not None:
            headers += ((MODEL_VERSION, self.version.encode()),)
        object.__setattr__(self, "reply_headers", headers)  # a frozen dataclass sets its derived fields so


class Router:
    """Picks a record's model from its headers and topic (poll thread only)."""

    def __init__(self, routes: Iterable[ModelRoute], topics: Mapping[str, str] | None = None) -> None:
        """``routes``: the served models, the default first; ``topics``: request topic -> model name."""
        self._routes = {route.name: route for route in routes}
        if not self._routes:
            raise ValueError("a router needs at least one model")
        self.default = next(iter(self._routes.values()))
        self._by_topic = {topic: self._routes[name] for topic, name in (topics or {}).items()}

    def for_topic(self, topic: str) -> ModelRoute:
        """The model of a record whose headers name none: its topic's, else the default."""
        return self._by_topic.get(topic, self.default)

    def route(self, topic: str, headers: list[tuple[str, bytes | None]]) -> ModelRoute:
        """The record's model; ``RequestError`` (``model_not_found``, or ``bad_request`` for a header that is not
        UTF-8) when its headers name one this process does not serve."""
        name, version = oip.named_model(headers)
        route: ModelRoute | None
        if name is None:
            route = self._by_topic.get(topic, self.default)
        else:
            route = self._routes.get(name)
            if route is None:
                raise RequestError(f"model {name!r} is not served here (served: {', '.join(self._routes)})",
                                   ErrorCode.MODEL_NOT_FOUND)
        if version is not None and route.version is not None and version != route.version:
            raise RequestError(f"model {route.name!r} version {version!r} is not served here (version "
                               f"{route.version!r} is)", ErrorCode.MODEL_NOT_FOUND)
        return route

