"""Serve a TorchServe model archive unchanged: ``--handler torchserve --model model.mar`` (or its extracted
directory). Needs ``pip install 'kinference[torchserve]'`` (TorchServe's Python package; no Java).

What happens as in TorchServe:

- The archive's ``MAR-INF/MANIFEST.json`` names the handler, the serialized file, the model file and the extra
  files; the archive is extracted to a temporary directory, which goes first on ``sys.path`` while the handler
  loads and initializes (each archive has its own import root: see ``_import_root``). The handler is
  loaded by TorchServe's own model loader: a module of the archive (``handler.py``, ``handler.py:function``)
  or a stock handler by name (``base_handler``, ``image_classifier``...), and ``initialize(context)`` is
  called once.
- The ``Context`` is TorchServe's, with ``system_properties`` (model_dir, gpu_id, batch_size), the
  ``manifest``, ``model_yaml_config`` (the archive's model-config YAML, ``{}`` when none), per-request headers
  (``get_request_header``: the Kafka record's headers) and ``metrics``: TorchServe's metrics API
  (``add_time``, ``add_counter``, ``add_metric``...), recorded as Prometheus metrics ``kinference_ts_<name>``
  on the service's /metrics.
- Each request reaches the handler as TorchServe's ``{"body": value}`` (``input_name`` option: ``data``
  for handlers that read form fields), the value decoded by the record's ``content-type`` header as
  TorchServe decodes it: ``application/json`` -> parsed JSON, ``text/*`` -> str, else bytes.
- Results: one per request. A str, dict, list or number is the reply's ``result``; bytes become
  ``{"content_type": ..., "base64": ...}``; a tensor becomes a list. A request whose status the handler set to
  4xx (``context.set_response_status(400, "why", idx)``) gets ``bad_request`` with that phrase, 5xx
  ``handler_error``; so does every request of a micro-batch for which the handler raises TorchServe's
  ``PredictionException`` with that code.

What kinference does better: the batch settings (``batchSize``, ``maxBatchDelay``, ``micro_batching``) are
read from the archive and mapped onto kinference's (see ``torchserve_archive.batch_settings``), and a
``BaseHandler`` subclass that keeps BaseHandler's ``handle`` has its ``preprocess``, ``inference`` and
``postprocess`` run on kinference's stage threads, so the CPU decodes one micro-batch while the model runs
another (option ``stages``: ``auto``, ``split`` or ``whole``). Otherwise ``handle(data, context)`` runs whole
in the inference stage. Because stages of different micro-batches run at once, the context's per-request
fields (request processors, request ids) are kept per thread; a handler that carries state of one batch on
``self`` from ``preprocess`` to ``postprocess`` needs ``stages=whole``.

Not supported (TorchServe HTTP API features): the management API, explanations (``/explanations``) and
``describe``, streaming responses (``send_intermediate_predict_response``), request envelopes, installing the
archive's ``requirements.txt`` (install them in the image), the torch profiler switch and sequence batching.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kinference.errors import HandlerLoadError, InvalidInput, RequestError
from kinference.handlers.base import Handler, HandlerContext, Record
from kinference.handlers.options import one_of, with_defaults
from kinference.handlers.torchserve_archive import Archive, batch_settings, opened
from kinference.protocol import ErrorCode

log = logging.getLogger(__name__)

try:
    import ts
    from ts.context import Context, RequestProcessor
    from ts.metrics.metric_cache_abstract import MetricCacheAbstract
    from ts.metrics.metric_cache_errors import MetricsCacheKeyError
    from ts.metrics.metric_type_enum import MetricTypes
    from ts.model_loader import TsModelLoader
    from ts.torch_handler.base_handler import BaseHandler
    from ts.utils.util import PredictionException
except ImportError as exc:  # kinference[torchserve] is not installed: the handler says so at setup
    _MISSING: ImportError | None = exc
    Context = MetricCacheAbstract = object  # the classes below are then defined but never instantiated
else:
    _MISSING = None


@dataclass(frozen=True, slots=True)
class TorchServeRequest:
    """One request in TorchServe's shape: the row the handler gets, its headers and status, and its id."""

    row: dict[str, Any]
    processor: Any
    """Its ``ts.context.RequestProcessor``: the request's headers, and the status the handler sets."""
    request_id: str


@dataclass(frozen=True, slots=True)
class Failed:
    """A micro-batch for which the handler raised ``PredictionException``: every request gets this error."""

    error: RequestError


@dataclass(frozen=True, slots=True)
class InFlight:
    """What travels from stage to stage: the micro-batch's requests (the inference stage needs their context)
    and the handler's data for the next stage, or its failure."""

    requests: list[TorchServeRequest]
    data: Any


class TorchServeHandler(Handler):
    name = "torchserve"
    payload_format = "record"
    defaults: dict[str, Any] = {"stages": "auto", "input_name": "body", "ts_config": None}

    @classmethod
    def batching_defaults(cls, model: Path | None, options: Mapping[str, Any]) -> dict[str, Any]:
        """The batch settings TorchServe would give the archive (``torchserve_archive.batch_settings``), so
        that it is batched as TorchServe would batch it unless told otherwise."""
        if model is None:
            return {}
        ts_config = options.get("ts_config")
        return batch_settings(Path(model), Path(ts_config) if ts_config else None)

    def setup(self, context: HandlerContext) -> None:
        if _MISSING is not None:
            raise HandlerLoadError("the torchserve handler needs TorchServe's Python package: pip install "
                                   f"'kinference[torchserve]' ({_MISSING})")
        # ts_config only gives batch settings (batching_defaults): nothing more to do with it here.
        options = with_defaults(self.name, self.defaults, context.options)
        stages = one_of(self.name, "stages", options["stages"], ("auto", "split", "whole"))
        self.input_name = one_of(self.name, "input_name", options["input_name"], ("body", "data"))
        if context.model is None:
            raise HandlerLoadError("torchserve needs --model: a .mar archive or its extracted directory")
        self.device = context.device
        self._resources = ExitStack()
        try:
            self.archive = self._resources.enter_context(opened(context.model))
            self.context, self.entry_point = _loaded(self.archive, context)
        except BaseException:
            self._resources.close()
            raise
        instance: Any = getattr(self.entry_point, "__self__", None)
        splittable = isinstance(instance, BaseHandler) and type(instance).handle is BaseHandler.handle
        if stages == "split" and not splittable:
            self._resources.close()
            raise HandlerLoadError(f"torchserve: stages=split needs a BaseHandler subclass that keeps "
                                   f"BaseHandler.handle; {self.archive.handler} provides {self.entry_point!r}")
        self.split = splittable and stages != "whole"
        self.instance = instance
        if self.split:
            instance.context = self.context  # what BaseHandler.handle sets before each batch
        log.info("torchserve: model %s, handler %s: %s", self.archive.name, self.archive.handler,
                 "preprocess, inference and postprocess on kinference's stages" if self.split
                 else "handle() whole in the inference stage")

    def validate(self, payload: Record) -> TorchServeRequest:
        content_type = next((value for name, value in payload.headers.items() if name.lower() == "content-type"), "")
        return TorchServeRequest({self.input_name: _decoded(payload.value, content_type)},
                                 RequestProcessor(payload.headers), payload.correlation_id)

    def preprocess(self, items: list[TorchServeRequest]) -> InFlight:
        data = [item.row for item in items]
        return InFlight(items, self._call(self.instance.preprocess, items, data) if self.split else data)

    def inference(self, inputs: InFlight) -> InFlight:
        if isinstance(inputs.data, Failed):
            return inputs
        if self.split:
            return InFlight(inputs.requests, self._call(self.instance.inference, inputs.requests, inputs.data))
        return InFlight(inputs.requests, self._call(self.entry_point, inputs.requests, inputs.data, self.context))

    def postprocess(self, outputs: InFlight, items: list[TorchServeRequest]) -> list[Any]:
        results = outputs.data
        if self.split and not isinstance(results, Failed):
            results = self._call(self.instance.postprocess, items, results)
        if isinstance(results, Failed):
            return [results.error] * len(items)
        if not isinstance(results, list) or len(results) != len(items):
            count = len(results) if isinstance(results, list) else f"a {type(results).__name__} instead of a list of"
            raise RequestError(f"the TorchServe handler returned {count} results for {len(items)} requests",
                               ErrorCode.HANDLER_ERROR)
        return [_result(result, item.processor) for result, item in zip(results, items, strict=True)]

    def _call(self, function: Callable[..., Any], requests: list[TorchServeRequest], *args: Any) -> Any:
        """``function(*args)`` with this thread's context showing ``requests``; PredictionException -> Failed."""
        with self.context.serving(requests):
            try:
                return function(*args)
            except PredictionException as exc:
                return Failed(RequestError(exc.message, _code(exc.error_code)))

    def warm_up(self) -> None:
        """Nothing: TorchServe handlers warm up in ``initialize`` when they need to, and a made-up request
        could fail a handler that checks its input."""

    def describe(self) -> dict[str, str]:
        return {"handler": self.name, "model": self.archive.name, "torchserve_handler": self.archive.handler,
                "stages": "split" if self.split else "whole", "device": self.device}

    def close(self) -> None:
        self._resources.close()


class StageContext(Context):
    """TorchServe's ``Context`` whose per-request fields (the request processors, the request ids) belong to
    the calling thread: kinference runs preprocess, inference and postprocess of different micro-batches at
    once, and a handler reads them through the one shared context (``get_request_header(idx, ...)``)."""

    request_processor: Any
    """Context's list of the batch's request processors: this thread's (``_request_processor``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._thread = threading.local()
        super().__init__(*args, **kwargs)

    @property
    def _request_processor(self) -> Any:
        return getattr(self._thread, "processors", None)

    @_request_processor.setter
    def _request_processor(self, processors: Any) -> None:
        self._thread.processors = processors

    @property
    def request_ids(self) -> Any:
        return getattr(self._thread, "ids", None)

    @request_ids.setter
    def request_ids(self, ids: Any) -> None:
        self._thread.ids = ids

    @contextmanager
    def serving(self, requests: list[TorchServeRequest]) -> Iterator[None]:
        self.request_processor = [request.processor for request in requests]
        self.request_ids = {index: request.request_id for index, request in enumerate(requests)}
        try:
            yield
        finally:
            self.request_processor = self.request_ids = None


def _loaded(archive: Archive, context: HandlerContext) -> tuple[StageContext, Callable[..., Any]]:
    """The archive's handler loaded as TorchServe's worker loads it, in the archive's own import root, and its
    context after ``initialize``."""
    directory = str(archive.directory.resolve())
    with _import_root(directory):
        _forget_other_copies(archive, directory)
        entry_point, initialize = _entry_point(archive)
        gpu_id = int(context.device.partition(":")[2] or 0) if context.device.startswith("cuda") else None
        metrics = PrometheusMetrics(context.registry or CollectorRegistry(), archive.name)
        # The archive's own reader: configFile is read from inside the archive only (TorchServe's get_yaml_config
        # would follow "../x.yaml" out of it).
        stage_context = StageContext(archive.name, directory, archive.manifest, context.max_batch_size, gpu_id,
                                     ts.__version__, True, metrics, archive.config())
        try:
            initialize(stage_context)
        except Exception as exc:
            raise HandlerLoadError(f"torchserve: {archive.handler}'s initialize failed: {exc!r}") from exc
    return stage_context, entry_point


@contextmanager
def _import_root(directory: str) -> Iterator[None]:
    """``directory`` first on ``sys.path`` while the archive's code loads; on exit it leaves ``sys.path``, and every
    module loaded from it leaves ``sys.modules`` (the handler keeps what it imported). So each archive's modules
    resolve inside that archive, and two archives of one process never share one: archives reuse names such as
    ``helpers`` (TorchServe runs one model per process), and an entry left behind made the next archive run the
    first one's code. A module of the archive imported inside a call, after ``initialize``, is therefore not
    found: import them at module level or in ``initialize``."""
    sys.path.insert(0, directory)
    try:
        yield
    finally:
        sys.path.remove(directory)
        inside = directory + os.sep
        for name, module in list(sys.modules.items()):
            if str(getattr(module, "__file__", None) or "").startswith(inside):
                del sys.modules[name]


def _entry_point(archive: Archive) -> tuple[Callable[..., Any], Callable[[Any], None]]:
    """TorchServe's rules (ts.model_loader): ``module[:function]`` from the archive, else a stock handler of
    ``ts.torch_handler``; a function entry point, else the module's one class, instantiated."""
    loader = TsModelLoader()
    try:
        try:
            module, function_name = loader._load_handler_file(archive.handler)
        except ImportError as own:
            if (archive.directory / _module_file(archive.handler)).exists():
                raise own  # the archive's handler exists but cannot import: say why, not "no stock handler"
            module, function_name = loader._load_default_handler(archive.handler), None
        function_name = function_name or "handle"
        entry: tuple[Callable[..., Any], Callable[[Any], None]] = (
            loader._get_function_entry_point(module, function_name) if hasattr(module, function_name)
            else loader._get_class_entry_point(module))
        return entry
    except (ImportError, ValueError) as exc:
        raise HandlerLoadError(f"torchserve: cannot load the handler {archive.handler!r} of {archive.name}: "
                               f"{exc!r}") from exc


def _module_file(handler: str) -> str:
    module = handler.split(":", 1)[0].split("/")[-1]
    return module if module.endswith(".py") else f"{module}.py"


def _forget_other_copies(archive: Archive, directory: str) -> None:
    """A module of the archive's handler or model file imported from outside any archive (other archives' modules
    leave ``sys.modules`` once loaded) would be reused by the import system instead of this archive's: drop it."""
    for file in (_module_file(archive.handler), archive.model.get("modelFile") or ""):
        module = sys.modules.get(Path(file).stem)
        if module is not None and not str(getattr(module, "__file__", "")).startswith(directory):
            del sys.modules[Path(file).stem]


def _code(status: int) -> ErrorCode:
    return ErrorCode.BAD_REQUEST if 400 <= status < 500 else ErrorCode.HANDLER_ERROR


def _decoded(value: bytes, content_type: str) -> Any:
    """The request value as TorchServe hands it to a handler (ts.protocol.otf_message_handler)."""
    try:
        if content_type == "application/json":
            return json.loads(value.decode("utf-8"))
        if content_type.startswith("text"):
            return value.decode("utf-8")
    except ValueError as exc:  # TorchServe forwards the raw bytes with a warning; a Kafka caller wants to know
        raise InvalidInput(f"the value does not decode as its content-type {content_type}: {exc}") from exc
    return value


def _result(output: Any, processor: Any) -> Any:
    status = processor.get_response_status_code()
    if status is not None and status >= 400:
        phrase = processor.get_response_status_phrase() or "no reason given"
        return RequestError(f"the handler answered {status}: {phrase}", _code(status))
    if isinstance(output, bytes | bytearray):
        content_type = processor.get_response_headers().get("content-type", "application/octet-stream")
        return {"content_type": content_type, "base64": base64.b64encode(output).decode()}
    if isinstance(output, torch.Tensor):
        return output.tolist()
    return output


# --- TorchServe's metrics API, recorded as Prometheus metrics

_NOT_A_NAME = re.compile(r"[^A-Za-z0-9_]")
_KINDS = {"COUNTER": Counter, "GAUGE": Gauge, "HISTOGRAM": Histogram}


class PrometheusMetrics(MetricCacheAbstract):
    """``context.metrics`` for TorchServe handlers: ``add_time("HandlerTime", 12.5)``, ``add_counter``,
    ``add_metric``... become Prometheus metrics ``kinference_ts_<name>[_<unit>]`` with the dimensions as labels
    (TorchServe's default ModelName and Level included; request ids are left out: unbounded)."""

    def __init__(self, registry: Any, model_name: str) -> None:
        super().__init__(config_file_path="")
        self.model_name = model_name
        self._registry = registry
        self._lock = threading.Lock()

    def initialize_cache(self) -> None:
        """Nothing to read: every metric is created on first use."""

    def _get_req(self, idx: Any) -> str:
        """No request-id label (unbounded); and every model metric gets TorchServe's ModelName and Level=Model
        dimensions (TorchServe adds them only once request ids are set)."""
        return ""

    def _add_default_dims(self, idx: Any, dimensions: list[Any]) -> list[Any]:
        # A copy: TorchServe's API passes one shared default list, which its own implementation appends to.
        dims: list[Any] = super()._add_default_dims(idx, list(dimensions))
        return dims

    def get_metric(self, metric_name: str, metric_type: Any = None) -> PrometheusMetric:
        try:
            metric: PrometheusMetric = self.cache[(_kind(metric_type), metric_name)]
        except KeyError:
            raise MetricsCacheKeyError(f"metric {metric_name} of type {metric_type} is not known") from None
        return metric

    def add_metric_to_cache(self, metric_name: str, unit: str, dimension_names: list[str] | None = None,
                            metric_type: Any = None) -> PrometheusMetric:
        kind = _kind(metric_type)
        with self._lock:
            metric: PrometheusMetric | None = self.cache.get((kind, metric_name))
            if metric is None:
                metric = self.cache[(kind, metric_name)] = PrometheusMetric(
                    metric_name, unit, list(dimension_names or []), kind, self._registry)
            return metric


class PrometheusMetric:
    def __init__(self, name: str, unit: str, dimension_names: list[str], kind: str, registry: Any) -> None:
        suffix = f"_{unit}" if unit and unit != "count" else ""
        self.name = name
        self.kind = kind
        self.dimension_names = dimension_names
        self._metric = _KINDS[kind](_NOT_A_NAME.sub("_", f"kinference_ts_{name}{suffix}"),
                                    f"TorchServe handler metric {name} ({unit or 'no unit'}, {kind.lower()}).",
                                    [_NOT_A_NAME.sub("_", label) for label in dimension_names], registry=registry)

    def add_or_update(self, value: float, dimension_values: list[str] | None = None, request_id: str = "") -> None:
        values = [str(value) for value in dimension_values or []]
        if len(values) != len(self.dimension_names):
            log.warning("torchserve metric %s: %d dimension values for %s; not recorded", self.name, len(values),
                        self.dimension_names)
            return
        metric = self._metric.labels(*values) if values else self._metric
        try:
            if self.kind == "COUNTER":
                metric.inc(value)
            elif self.kind == "GAUGE":
                metric.set(value)
            else:
                metric.observe(value)
        except (TypeError, ValueError) as exc:  # TorchServe logs a bad value and goes on
            log.warning("torchserve metric %s: %r not recorded: %s", self.name, value, exc)

    def update(self, value: float, request_id: str = "", dimensions: list[Any] | None = None) -> None:
        """TorchServe's older API: dimensions as ``Dimension`` objects."""
        self.add_or_update(value, [dimension.value for dimension in dimensions or []], request_id)


def _kind(metric_type: Any) -> str:
    return metric_type.name if isinstance(metric_type, MetricTypes) else "COUNTER"
