"""The Open Inference Protocol (V2) codec: requests as the OIP spec and MLServer's Kafka clients send them, responses
as the spec defines them, checked against MLServer's own pydantic types where an MLServer package is at hand
(``KINFERENCE_TEST_MLSERVER``: a directory holding the ``mlserver`` package, as ``make test`` installs it)."""

from __future__ import annotations

import base64
import importlib
import os
import sys
import types
from pathlib import Path

import numpy as np
import orjson
import pytest

from kinference.consumer.delivery.answers import reply_value
from kinference.consumer.path.request import RequestDecoder
from kinference.consumer.wire import oip
from kinference.errors import RequestError
from kinference.protocol import CORRELATION_ID, ErrorCode
from tests.fakes import FakeRecord
from tests.timing import cost_ratio

MODEL = oip.ServedModel("minilm", "2")
MLSERVER_HEADERS = [(oip.MODEL_HEADER, b"minilm")]


def request(**body) -> bytes:
    return orjson.dumps({"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["hi"]}], **body})


def test_a_text_request_becomes_the_handlers_payload_and_the_key_its_id():
    payload, call = oip.decode(request(id="body-id"), b"key-7", dict(MLSERVER_HEADERS), MODEL, "json", "c")
    assert payload == {"text": "hi"} and call.id == "key-7"  # MLServer: the Kafka key wins over the body's id
    assert oip.decode(request(id="body-id"), None, {}, MODEL, "json", "c")[1].id == "body-id"
    assert oip.decode(request(), None, {}, MODEL, "json", "fallback")[1].id == "fallback"


def test_tensors_keep_their_shape_without_the_batch_dimension():
    body = orjson.dumps({"id": "42", "inputs": [
        {"name": "input0", "shape": [1, 2, 2], "datatype": "UINT32", "data": [1, 2, 3, 4]},
        {"name": "nested", "shape": [1, 3], "datatype": "FP32", "data": [[0.5, 1.5, 2.5]]},
        {"name": "flag", "shape": [1], "datatype": "BOOL", "data": [True]}]})
    payload, _ = oip.decode(body, None, {}, MODEL, "json", "c")
    assert payload == {"input0": [[1, 2], [3, 4]], "nested": [0.5, 1.5, 2.5], "flag": True}


@pytest.mark.parametrize(("body", "fragment"), [
    ({"inputs": []}, 'non-empty "inputs"'),
    ({"inputs": [{"name": "t", "shape": [2], "datatype": "BYTES", "data": ["a", "b"]}]}, "first dimension must be 1"),
    ({"inputs": [{"name": "t", "shape": [1, 3], "datatype": "FP32", "data": [1, 2]}]}, "holds 3 elements, data has 2"),
    ({"inputs": [{"name": "t", "shape": [1], "datatype": "FP99", "data": [1]}]}, '"datatype" \'FP99\''),
    ({"inputs": [{"name": "t", "shape": [1], "datatype": "FP32", "data": ["x"]}]}, "must be numbers"),
    ({"inputs": [{"name": "t", "shape": [1], "datatype": "BOOL", "data": [1]}]}, "must be booleans"),
    ({"inputs": [{"name": "t", "shape": [1], "datatype": "BYTES", "data": [1]}]}, "must be strings"),
    ({"inputs": [{"shape": [1], "datatype": "BYTES", "data": ["a"]}]}, 'needs a "name"'),
    ({"inputs": [{"name": "t", "shape": [1], "datatype": "BYTES", "data": ["a"]}], "outputs": ["x"]},
     '"outputs" must be a list'),
])
def test_malformed_requests_are_bad_requests_that_say_why(body, fragment):
    with pytest.raises(RequestError, match=None) as raised:
        oip.decode(orjson.dumps(body), None, {}, MODEL, "json", "c")
    assert raised.value.code == ErrorCode.BAD_REQUEST and fragment in raised.value.message


def test_another_model_or_version_is_model_not_found():
    for headers in ({oip.MODEL_HEADER: b"other"}, {oip.MODEL_HEADER: b"minilm", oip.VERSION_HEADER: b"1"}):
        with pytest.raises(RequestError) as raised:
            oip.decode(request(), None, headers, MODEL, "json", "c")
        assert raised.value.code == ErrorCode.MODEL_NOT_FOUND
    unversioned = oip.ServedModel("minilm")
    assert oip.decode(request(), None, {oip.VERSION_HEADER: b"7"}, unversioned, "json", "c")[0] == {"text": "hi"}


def test_bytes_handlers_get_the_one_bytes_input_base64_decoded():
    image = b"\xff\xd8\xff\xe0 jpeg"
    body = orjson.dumps({"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES",
                                     "data": [base64.b64encode(image).decode()],
                                     "parameters": {"content_type": "base64"}}]})
    assert oip.decode(body, None, {}, MODEL, "bytes", "c")[0] == image
    with pytest.raises(RequestError, match="one BYTES input"):
        oip.decode(orjson.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}),
                   None, {}, MODEL, "bytes", "c")


def test_results_become_typed_output_tensors_with_the_batch_dimension():
    call = oip.OipCall("42", MODEL, None)
    result = {"embedding": np.arange(4, dtype=np.float32), "count": 3, "label": "positive",
              "labels": [{"label": "a", "score": 0.5}], "scores": [[0.25, 0.75]]}
    response = orjson.loads(call.response(result))
    assert (response["model_name"], response["model_version"], response["id"]) == ("minilm", "2", "42")
    outputs = {output["name"]: output for output in response["outputs"]}
    assert outputs["embedding"] == {"name": "embedding", "shape": [1, 4], "datatype": "FP32",
                                    "data": [0.0, 1.0, 2.0, 3.0], "parameters": {"content_type": "np"}}
    assert (outputs["count"]["shape"], outputs["count"]["datatype"], outputs["count"]["data"]) == ([1], "INT64", [3])
    assert outputs["label"] == {"name": "label", "shape": [1, 1], "datatype": "BYTES", "data": ["positive"],
                                "parameters": {"content_type": "str"}}
    assert outputs["labels"]["parameters"] == {"content_type": "json"}  # MLServer's JSON codec
    assert orjson.loads(outputs["labels"]["data"][0]) == [{"label": "a", "score": 0.5}]
    assert (outputs["scores"]["shape"], outputs["scores"]["datatype"]) == ([1, 1, 2], "FP64")
    assert orjson.loads(call.response([1, 2]))["outputs"][0]["name"] == "output"


def test_requested_outputs_are_kept_in_order_and_a_missing_one_fails():
    call = oip.OipCall("1", MODEL, ("b", "a"))
    assert [o["name"] for o in orjson.loads(call.response({"a": 1, "b": 2, "c": 3}))["outputs"]] == ["b", "a"]
    with pytest.raises(RequestError, match="requested output"):
        oip.OipCall("1", MODEL, ("z",)).response({"a": 1})


def test_the_decoder_answers_oip_requests_in_oip_even_when_they_fail():
    decoder = RequestDecoder("replies", 10_000, model=MODEL)
    ok = decoder.decode(FakeRecord(request(), key=b"k1", headers=MLSERVER_HEADERS))
    assert ok.payload == {"text": "hi"} and ok.reply_format.id == "k1" and ok.error is None
    plain = decoder.decode(FakeRecord(b'{"text": "hi"}', headers=[(CORRELATION_ID, b"c")]))
    assert plain.reply_format is None and plain.payload == {"text": "hi"}  # auto: no mlserver-model header, no OIP
    broken = decoder.decode(FakeRecord(b"{oops", key=b"k2", headers=MLSERVER_HEADERS))
    assert broken.dead_letter and broken.reply_format.id == "k2"
    assert orjson.loads(reply_value(broken)) == {"error": broken.error.message}
    wrong = decoder.decode(FakeRecord(request(), key=b"k3", headers=[(oip.MODEL_HEADER, b"nope")]))
    assert wrong.error.code == ErrorCode.MODEL_NOT_FOUND and "nope" in orjson.loads(reply_value(wrong))["error"]
    forced = RequestDecoder("replies", 10_000, model=oip.ServedModel("m", request_format="oip"))
    assert forced.decode(FakeRecord(request())).payload == {"text": "hi"}  # oip: no header needed


# --- against MLServer's own types


def mlserver_types() -> types.ModuleType:
    """``mlserver.types`` (pydantic models generated from the OIP spec) from the directory in
    ``KINFERENCE_TEST_MLSERVER``, without ``mlserver/__init__.py`` (which imports its whole server)."""
    where = os.environ.get("KINFERENCE_TEST_MLSERVER")
    if not where or not (Path(where) / "mlserver" / "types").is_dir():
        pytest.skip("no MLServer package to compare with: set KINFERENCE_TEST_MLSERVER to a directory holding one "
                    "(make test does: pip install --no-deps --target DIR mlserver)")
    if "mlserver" not in sys.modules:
        parent = types.ModuleType("mlserver")
        parent.__path__ = [str(Path(where) / "mlserver")]
        sys.modules["mlserver"] = parent
    return importlib.import_module("mlserver.types")


def test_requests_and_responses_are_mlservers_types():
    mlserver = mlserver_types()
    sent = mlserver.InferenceRequest(id="7", inputs=[mlserver.RequestInput(
        name="text", shape=[1], datatype="BYTES", data=["hello"])], outputs=[mlserver.RequestOutput(name="embedding")])
    payload, call = oip.decode(sent.model_dump_json().encode(), None, {}, MODEL, "json", "c")
    assert payload == {"text": "hello"} and call.outputs == ("embedding",)
    body = orjson.loads(call.response({"embedding": np.ones(3, dtype=np.float32), "note": "x"}))
    parsed = mlserver.InferenceResponse(**body)
    assert parsed.id == "7" and parsed.model_name == "minilm" and [o.name for o in parsed.outputs] == ["embedding"]
    assert parsed.outputs[0].datatype == "FP32" and parsed.outputs[0].shape == [1, 3]
    every_kind = orjson.loads(oip.OipCall("8", MODEL, None).response(
        {"a": 1, "b": "s", "c": [{"x": 1}], "d": [True, False], "e": np.zeros((2, 2), dtype=np.int32)}))
    assert len(mlserver.InferenceResponse(**every_kind).outputs) == 5


def test_a_shape_bomb_is_a_bad_request_refused_before_any_arithmetic(monkeypatch):
    """Issue 20, defect 2: a 945 KB request whose shape has 45,000 dimensions of 2**64-1 cost about 10 s of
    big-integer products in the poll thread, twice, and was answered internal_error. The shape is bounded before
    any arithmetic now: every product is taken over at most MAX_DIMENSIONS sizes no larger than the request."""
    products = []

    def prod(shape):
        products.append(list(shape))
        assert len(shape) <= oip.MAX_DIMENSIONS and max(shape) <= len(body), "a product over an unbounded shape"
        return np.prod(shape, dtype=object)

    monkeypatch.setattr(oip.math, "prod", prod)
    body = orjson.dumps({"inputs": [{"name": "x", "shape": [1] + [2**64 - 1] * 45_000, "datatype": "FP32",
                                     "data": [1.0]}]})
    assert len(body) > 900_000
    with pytest.raises(RequestError) as raised:
        oip.decode(body, None, {}, MODEL, "json", "c")
    assert raised.value.code == ErrorCode.BAD_REQUEST and "1 to 8 sizes" in raised.value.message
    assert products == []
    # A shape within the bounds is still checked against the data, over a bounded product.
    wide = orjson.dumps({"inputs": [{"name": "x", "shape": [1, 2, 3], "datatype": "FP32", "data": [1.0] * 6}]})
    body = wide
    assert oip.decode(wide, None, {}, MODEL, "json", "c")[0] == {"x": [[1.0] * 3] * 2}
    assert products == [[1, 2, 3]]


@pytest.mark.parametrize(("body", "message"), [
    # Issue 20, defect 9: both were internal_error (an AttributeError, numpy's "maximum supported dimension").
    ({"inputs": [{"name": "t", "shape": [1], "datatype": "BYTES", "data": ["a"], "parameters": [1]}]},
     '"parameters" must be an object'),
    ({"parameters": [1], "inputs": [{"name": "t", "shape": [1], "datatype": "BYTES", "data": ["a"]}]},
     '"parameters" must be an object'),
    ({"inputs": [{"name": "t", "shape": [1, 2**64 - 1, 0], "datatype": "FP32", "data": []}]}, "sizes"),
    ({"inputs": [{"name": "t", "shape": [1] * 9, "datatype": "FP32", "data": [1]}]}, "1 to 8 sizes"),
    ({"inputs": [{"name": "t", "shape": [0], "datatype": [], "data": []}]}, '"datatype" '),  # found by the fuzz pass
    # Ragged data: nested data must match the shape it claims (it was reshaped from its flattened elements).
    ({"inputs": [{"name": "t", "shape": [1, 2, 2], "datatype": "FP32", "data": [[[1, 2, 3], [4]]]}]}, "ragged"),
    ({"inputs": [{"name": "t", "shape": [1, 4], "datatype": "FP32", "data": [[1, 2], [3, 4]]}]}, "ragged"),
    ({"inputs": [{"name": "t", "shape": [1, 2], "datatype": "FP32", "data": [[1, [2]]]}]}, "ragged"),
])
def test_malformed_requests_are_bad_requests_never_internal_errors(body, message):
    decoder = RequestDecoder("replies", 10_000, model=MODEL)
    decoded = decoder.decode(FakeRecord(orjson.dumps(body), headers=MLSERVER_HEADERS))
    assert decoded.error.code == ErrorCode.BAD_REQUEST and message in decoded.error.message


def test_nested_data_matching_the_shape_is_read_row_major():
    body = orjson.dumps({"inputs": [{"name": "t", "shape": [1, 2, 2], "datatype": "INT64",
                                     "data": [[[1, 2], [3, 4]]]}]})
    assert oip.decode(body, None, {}, MODEL, "json", "c")[0] == {"t": [[1, 2], [3, 4]]}


def test_nested_data_deeper_or_shallower_than_the_shape_is_ragged():
    for data in ([[[1, 2], [3, [4]]]], [[[1, 2], 3]], [[1, 2, 3, 4]]):
        body = orjson.dumps({"inputs": [{"name": "t", "shape": [1, 2, 2], "datatype": "INT64", "data": data}]})
        with pytest.raises(RequestError, match="not ragged"):
            oip.decode(body, None, {}, MODEL, "json", "c")


def test_a_wide_input_costs_about_what_a_normal_value_of_its_size_costs():
    """Issue 29, item 4: OIP's reading of ``data`` took Python steps per element and per inner list, and made the
    nested lists again (the garbage collector running over and over while it did). A ``[[[1],[1],...]]`` input
    of shape [1, n, 1] now costs within a small factor of a JSON list of short strings of the same size."""
    size = 480_000
    decoder = RequestDecoder("replies", max_request_bytes=size + 1000, model=MODEL)
    normal = b"[" + b",".join([b'"ab"'] * (size // 5)) + b"]"
    count = size // 4
    wide = orjson.dumps({"inputs": [{"name": "t", "shape": [1, count, 1], "datatype": "INT64",
                                     "data": [[[1]] * count]}]})
    flat = orjson.dumps({"inputs": [{"name": "t", "shape": [1, count, 1], "datatype": "INT64",
                                     "data": [1] * count}]})

    for name, value in (("wide", wide), ("flat", flat)):
        decoded = decoder.decode(FakeRecord(value, headers=MLSERVER_HEADERS))
        assert decoded.ok, decoded.error
        ratio = cost_ratio(lambda value=value: decoder.decode(FakeRecord(value, headers=MLSERVER_HEADERS)),
                           lambda: decoder.decode(FakeRecord(normal)))
        assert ratio < 15, f"a {len(value)}-byte {name} OIP input costs {ratio:.1f}x a normal value of {len(normal)}"


def test_a_request_nested_deeper_than_kinferences_json_may_is_a_bad_request():
    """Issue 29, item 4: OIP requests are bounded in depth as kinference's JSON is; before, parameters nested 100
    deep were decoded and kept."""
    deep: object = "x"
    for _ in range(100):
        deep = [deep]
    with pytest.raises(RequestError, match="deeper than 64 levels") as raised:
        oip.decode(request(parameters={"extra": deep}), None, {}, MODEL, "json", "c")
    assert raised.value.code == ErrorCode.BAD_REQUEST
