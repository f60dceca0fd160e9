"""The Open Inference Protocol (V2, KServe and MLServer) on Kafka: ``InferenceRequest`` values in,
``InferenceResponse`` values out, and MLServer's Kafka conventions, so an MLServer Kafka client moves over
unchanged.

Which requests speak it (``request_format``): ``auto`` (default) takes a record carrying MLServer's
``mlserver-model`` header as OIP and every other record as kinference's own JSON; ``oip`` takes every record as
OIP; ``kinference`` never does.

A request, as MLServer's Kafka server reads it:

- the value: ``{"id"?, "parameters"?, "inputs": [{"name", "shape", "datatype", "data", "parameters"?}],
  "outputs"?: [{"name"}]}``;
- ``mlserver-model`` names the model and ``mlserver-version`` its version: a model this service does not serve
  gets ``model_not_found``;
- the Kafka key, when there is one, is the request id (it takes precedence over the body's ``id``), as in
  MLServer; the reply carries that id and is keyed by it.

One record is one item: each input's first dimension must be 1 (kinference batches records itself). The
handler gets ``{input name: value}``, each value the input's data without that dimension (a single element
as itself, else nested lists); a ``bytes`` handler gets the one BYTES input's bytes (base64-decoded when its
``content_type`` parameter says ``base64``, as MLServer's Base64 codec sends them).

The response: ``{"model_name", "model_version"?, "id", "parameters": {}, "outputs": [...]}``, one output per
key of the handler's result (a result that is not an object is one output named ``output``): numbers and
arrays of numbers as ``FP32``/``FP64``/``INT64``/``BOOL`` tensors (``content_type`` ``np``), a string as
``BYTES`` (``str``), anything else as a ``BYTES`` element holding its JSON (``json``, MLServer's JSON codec);
each with the leading batch dimension of 1. ``outputs`` in the request keeps only those. An error is OIP's
``{"error": "<message>"}``, with kinference's error-code header beside it.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain
from typing import Any, ClassVar, Literal

import numpy as np
import orjson

from kinference.consumer.wire import jsonscan
from kinference.errors import RequestError
from kinference.protocol import MODEL, MODEL_VERSION, ErrorCode, PayloadFormat

RequestFormat = Literal["auto", "kinference", "oip"]
MODEL_HEADER = "mlserver-model"
VERSION_HEADER = "mlserver-version"
_MODEL_HEADERS = frozenset({MODEL, MODEL_VERSION, MODEL_HEADER, VERSION_HEADER})
MAX_DIMENSIONS = 8
"""The most dimensions an input tensor's ``shape`` may have (the batch dimension included)."""
DATATYPES = {"BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32",
             "FP64", "BYTES"}
_NUMPY_DATATYPES = {np.dtype(np.bool_): "BOOL", np.dtype(np.float16): "FP16", np.dtype(np.float32): "FP32",
                    np.dtype(np.float64): "FP64", np.dtype(np.int8): "INT8", np.dtype(np.int16): "INT16",
                    np.dtype(np.int32): "INT32", np.dtype(np.int64): "INT64", np.dtype(np.uint8): "UINT8"}


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What OIP requests may name: this service's model."""

    name: str
    version: str | None = None
    request_format: RequestFormat = "auto"

    def speaks_oip(self, headers: list[tuple[str, bytes | None]]) -> bool:
        return self.request_format == "oip" or (self.request_format == "auto"
                                                and any(name == MODEL_HEADER for name, _ in headers))


@dataclass(frozen=True, slots=True)
class OipCall:
    """An OIP request's id and what its response must hold."""

    id: str
    model: ServedModel
    outputs: tuple[str, ...] | None
    """The output names the request asked for; None for all."""
    value_headers: ClassVar[tuple[()]] = ()
    """An OIP value needs no header beside it."""

    def response(self, result: Any) -> bytes:
        outputs = _outputs(result)
        if self.outputs is not None:
            produced = {output["name"]: output for output in outputs}
            missing = [name for name in self.outputs if name not in produced]
            if missing:
                raise RequestError(f"requested output(s) {', '.join(missing)} not produced; the model produces "
                                   f"{', '.join(produced)}", ErrorCode.BAD_REQUEST)
            outputs = [produced[name] for name in self.outputs]
        body: dict[str, Any] = {"model_name": self.model.name, "id": self.id, "parameters": {}, "outputs": outputs}
        if self.model.version is not None:
            body["model_version"] = self.model.version
        return orjson.dumps(body)

    @staticmethod
    def error(code: ErrorCode, message: str) -> bytes:
        """OIP's error body: the message only (the code travels in the ``kinference-error-code`` header)."""
        return orjson.dumps({"error": message})


def decode(value: bytes | None, key: bytes | None, headers: dict[str, bytes | None], model: ServedModel,
           payload_format: PayloadFormat, fallback_id: str) -> tuple[Any, OipCall]:
    """(the handler's payload, the call) of an OIP request; ``RequestError`` for a request that is not one, or
    names another model."""
    named, version = named_model(headers.items())
    if named is not None and named != model.name:
        raise RequestError(f"model {named!r} is not served here (this service serves {model.name!r})",
                           ErrorCode.MODEL_NOT_FOUND)
    if version is not None and model.version is not None and version != model.version:
        raise RequestError(f"model {model.name!r} version {version!r} is not served here (version "
                           f"{model.version!r} is)", ErrorCode.MODEL_NOT_FOUND)
    try:
        body = jsonscan.loads_within_depth(value or b"")
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"the value is not an OIP InferenceRequest (not JSON: {exc})",
                           ErrorCode.BAD_REQUEST) from exc
    if not isinstance(body, dict) or not isinstance(body.get("inputs"), list) or not body["inputs"]:
        raise RequestError('an OIP InferenceRequest is an object with a non-empty "inputs" list',
                           ErrorCode.BAD_REQUEST)
    _parameters(body, "the request")
    request_id_ = request_id(key, body, fallback_id)
    outputs = body.get("outputs")
    if outputs is not None and (not isinstance(outputs, list)
                                or not all(isinstance(o, dict) and isinstance(o.get("name"), str) for o in outputs)):
        raise RequestError('"outputs" must be a list of {"name": ...}', ErrorCode.BAD_REQUEST)
    inputs = [_input(item, len(value or b"")) for item in body["inputs"]]
    call = OipCall(request_id_, model, tuple(o["name"] for o in outputs) if outputs is not None else None)
    if payload_format == "json":
        return {name: value for name, value, _ in inputs}, call
    if len(inputs) != 1 or not isinstance(inputs[0][2], bytes):
        raise RequestError("this model takes one BYTES input holding the raw value (base64 with "
                           '"parameters": {"content_type": "base64"})', ErrorCode.BAD_REQUEST)
    return inputs[0][2], call


def request_id(key: bytes | None, body: dict[str, Any], fallback: str) -> str:
    """The Kafka key when there is one (MLServer: it takes precedence over the body's id), else the body's
    ``id``, else ``fallback``."""
    if key:
        try:
            return key.decode("utf-8")
        except UnicodeDecodeError:
            return key.hex()
    given = body.get("id")
    return given if isinstance(given, str) and given else fallback


def _check_elements(flat: list[Any], datatype: str, where: str) -> None:
    """Every element is of the input's datatype: strings for BYTES, booleans for BOOL, numbers otherwise. The
    element types are collected at C speed (``set(map(type, ...))``): a Python step per element cost ~0.5 s for
    a 960 KB input in the poll thread."""
    types = set(map(type, flat))
    if datatype == "BYTES":
        if not types <= {str}:
            raise RequestError(f"{where}: BYTES data must be strings", ErrorCode.BAD_REQUEST)
    elif not (types <= {bool} if datatype == "BOOL" else types <= {int, float}):
        raise RequestError(f"{where}: {datatype} data must be {'booleans' if datatype == 'BOOL' else 'numbers'}",
                           ErrorCode.BAD_REQUEST)


def _input(item: Any, request_bytes: int) -> tuple[str, Any, bytes | None]:
    """(name, value without the batch dimension, raw bytes of a one-element BYTES input) of one input tensor.

    The shape is bounded before any arithmetic on it (at most ``MAX_DIMENSIONS``, each no larger than the
    request's ``request_bytes``: one element takes at least a byte of JSON): 45,000 dimensions of 2**64-1 once
    cost seconds of big-integer products in the poll thread. What is left is linear in the request's bytes."""
    if not isinstance(item, dict):
        raise RequestError("each OIP input is an object", ErrorCode.BAD_REQUEST)
    name, shape, datatype = item.get("name"), item.get("shape"), item.get("datatype")
    data: Any = item.get("data")
    if not isinstance(name, str) or not name:
        raise RequestError('each OIP input needs a "name"', ErrorCode.BAD_REQUEST)
    where = f"input {name[:100]!r}"
    if not (isinstance(shape, list) and 0 < len(shape) <= MAX_DIMENSIONS
            and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= request_bytes for d in shape)):
        raise RequestError(f'{where}: "shape" must be a list of 1 to {MAX_DIMENSIONS} sizes, none larger than the '
                           f"request's {request_bytes} bytes can hold", ErrorCode.BAD_REQUEST)
    if not isinstance(datatype, str) or datatype not in DATATYPES:
        raise RequestError(f'{where}: "datatype" {str(datatype)[:20]!r} is not one of {", ".join(sorted(DATATYPES))}',
                           ErrorCode.BAD_REQUEST)
    if shape[0] != 1:
        raise RequestError(f"{where}: shape {shape}: one record is one item, so the first dimension must be 1 "
                           "(send one record per item: kinference batches them)", ErrorCode.BAD_REQUEST)
    parameters = _parameters(item, where)
    flat = _flatten(data, shape, where)
    if len(flat) != math.prod(shape):
        raise RequestError(f"{where}: shape {shape} holds {math.prod(shape)} elements, data has {len(flat)}",
                           ErrorCode.BAD_REQUEST)
    _check_elements(flat, datatype, where)
    if len(flat) == 1:
        value = flat[0]
    elif flat is not data:  # nested as the shape says already: the item is the batch dimension's one entry
        value = data[0]
    else:
        with jsonscan.collector_paused():  # as many lists as the shape says, each a tracked object
            value = np.asarray(flat, dtype=object).reshape(shape[1:]).tolist()
    raw = None
    if datatype == "BYTES" and len(flat) == 1:
        raw = _base64(flat[0], where) if parameters.get("content_type") == "base64" else flat[0].encode("utf-8")
    return name, value, raw


def _parameters(holder: dict[str, Any], where: str) -> dict[str, Any]:
    """The ``parameters`` object of the request or of an input; empty when there is none."""
    parameters = holder.get("parameters")
    if parameters is None:
        return {}
    if not isinstance(parameters, dict):
        raise RequestError(f'{where}: "parameters" must be an object', ErrorCode.BAD_REQUEST)
    return parameters


def _flatten(data: Any, shape: list[int], where: str) -> list[Any]:
    """The elements of ``data`` in row-major order: ``data`` is flat, or nested exactly as ``shape`` says (every
    list at depth d holds ``shape[d]`` items; ragged data is refused). Iterative, no deeper than the shape, and
    the elements of each list are looked at in C (``set(map(type, ...))``), not one Python step each."""
    if not isinstance(data, list):
        raise RequestError('"data" must be a list (flat, or nested row-major)', ErrorCode.BAD_REQUEST)
    if list not in set(map(type, data)):
        return data
    flat: list[Any] = []
    level = [data]
    for depth, size in enumerate(shape):
        last = depth == len(shape) - 1
        types = set(map(type, level))
        if types != {list} or set(map(len, level)) != {size}:
            raise RequestError(f'{where}: nested "data" must match the shape {shape} (not ragged)',
                               ErrorCode.BAD_REQUEST)
        if last:
            flat = list(chain.from_iterable(level))
            if list in set(map(type, flat)):
                raise RequestError(f'{where}: nested "data" must match the shape {shape} (not ragged)',
                                   ErrorCode.BAD_REQUEST)
        else:
            level = list(chain.from_iterable(level))
    return flat


def _base64(text: str, where: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RequestError(f"{where}: not valid base64: {exc}", ErrorCode.BAD_REQUEST) from exc


def named_model(headers: Iterable[tuple[str, bytes | None]]) -> tuple[str | None, str | None]:
    """(model, version) a record's headers name, None where they name none. kinference's own headers take
    precedence over MLServer's: ``kinference-model`` over ``mlserver-model``, ``kinference-model-version`` over
    ``mlserver-version``; of a repeated header the last value counts (as Kafka clients read it). ``RequestError``
    (``bad_request``) for a value that is not UTF-8."""
    found: dict[str, str] = {}
    for name, raw in headers:
        if name in _MODEL_HEADERS and raw is not None:
            try:
                found[name] = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise RequestError(f"header {name} is not UTF-8", ErrorCode.BAD_REQUEST) from exc
    return (found.get(MODEL, found.get(MODEL_HEADER)),
            found.get(MODEL_VERSION, found.get(VERSION_HEADER)))


def _outputs(result: Any) -> list[dict[str, Any]]:
    named = result if isinstance(result, dict) else {"output": result}
    return [_tensor(str(name), value) for name, value in named.items()]


def _tensor(name: str, value: Any) -> dict[str, Any]:
    if isinstance(value, str):
        return {"name": name, "shape": [1, 1], "datatype": "BYTES", "data": [value],
                "parameters": {"content_type": "str"}}
    array = _numeric(value)
    if array is None:
        return {"name": name, "shape": [1, 1], "datatype": "BYTES",
                "data": [orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY).decode()],
                "parameters": {"content_type": "json"}}
    return {"name": name, "shape": [1, *array.shape], "datatype": _NUMPY_DATATYPES[array.dtype],
            "data": array.reshape(-1).tolist(), "parameters": {"content_type": "np"}}


def _numeric(value: Any) -> np.ndarray | None:
    """``value`` as a numeric array, or None when it is not a (nested, rectangular) array of numbers."""
    if isinstance(value, np.ndarray | np.generic):
        array = np.asarray(value)
        return array if array.dtype in _NUMPY_DATATYPES else None
    if isinstance(value, bool | int | float) or (isinstance(value, list) and value):
        try:
            array = np.asarray(value)
        except ValueError:  # ragged lists
            return None
        return array if array.dtype in _NUMPY_DATATYPES else None  # strings, objects, huge ints: not numbers
    return None
