"""Routing a record to one of several models (consumer/path/router.py), as the decoder applies it."""

from __future__ import annotations

import orjson
import pytest

from kinference.consumer.config import load_config
from kinference.consumer.delivery.answers import reply_headers
from kinference.consumer.path.request import RequestDecoder
from kinference.consumer.path.router import ModelRoute, Router
from kinference.consumer.wire import oip
from kinference.errors import ConfigError, RequestError
from kinference.protocol import MODEL, MODEL_VERSION, ErrorCode
from tests.fakes import FakeRecord

EMBED = ModelRoute("minilm", "2", "json", oip.ServedModel("minilm", "2"))
IMAGES = ModelRoute("resnet", None, "bytes")
ROUTER = Router([EMBED, IMAGES], {"images": "resnet"})


@pytest.mark.parametrize(("topic", "headers", "expected"), [
    ("requests", [], "minilm"),  # an unmapped topic, no header: the first model
    ("images", [], "resnet"),  # the topic's model
    ("images", [(MODEL, b"minilm")], "minilm"),  # the header wins over the topic
    ("requests", [(oip.MODEL_HEADER, b"resnet")], "resnet"),  # MLServer's header too
    ("requests", [(MODEL, b"resnet"), (MODEL, b"minilm")], "minilm"),  # the last of repeated headers
    ("requests", [(MODEL, b"minilm"), (MODEL_VERSION, b"2")], "minilm"),
    ("requests", [(MODEL, b"resnet"), (MODEL_VERSION, b"7")], "resnet"),  # an unversioned model takes any
])
def test_a_record_goes_to_the_model_its_header_names_else_its_topics_else_the_first(topic, headers, expected):
    assert ROUTER.route(topic, headers).name == expected


@pytest.mark.parametrize("headers", [[(MODEL, b"gpt")], [(oip.MODEL_HEADER, b"gpt")],
                                     [(MODEL, b"minilm"), (MODEL_VERSION, b"1")], [(MODEL_VERSION, b"1")]])
def test_a_model_or_version_not_served_is_model_not_found(headers):
    with pytest.raises(RequestError) as raised:
        ROUTER.route("requests", headers)
    assert raised.value.code == ErrorCode.MODEL_NOT_FOUND


def test_the_decoder_reads_each_value_as_its_models_handler_takes_it_and_replies_name_the_model():
    decoder = RequestDecoder("replies", 10_000, router=ROUTER)
    text = decoder.decode(FakeRecord(b'{"text": "hi"}'))
    assert text.ok and text.payload == {"text": "hi"} and text.model is EMBED
    image = decoder.decode(FakeRecord(b"\xff\xd8 raw bytes", headers=[(MODEL, b"resnet")]))
    assert image.ok and image.payload == b"\xff\xd8 raw bytes" and image.model is IMAGES
    headers = dict(reply_headers(text, now=text.received))
    assert (headers[MODEL], headers[MODEL_VERSION]) == (b"minilm", b"2")
    assert MODEL_VERSION not in dict(reply_headers(image, now=image.received))


@pytest.mark.parametrize(("topic", "headers", "expected", "oip_call"), [
    ("images", [("other", b"x"), (oip.MODEL_HEADER, None)], "resnet", False),  # named by no value: the topic's
    ("requests", [(oip.MODEL_HEADER, None)], "minilm", True),  # yet it asks for OIP, as MLServer's header does
    ("requests", [("other", None), (MODEL, b"resnet")], "resnet", False),
    ("images", [("other", b"x")], "resnet", False),  # no header names a model: the topic alone routes it
])
def test_the_decoder_reads_whether_a_header_names_a_model_in_its_one_pass_over_them(topic, headers, expected,
                                                                                    oip_call):
    """Issue 38: the decoder's pass over the headers also notes whether any names a model, so that a record with none
    (most) is routed by its topic, with no second and third pass for the model and for OIP."""
    decoded = RequestDecoder("replies", 10_000, router=ROUTER).decode(FakeRecord(b"{}", headers=headers, topic=topic))
    assert decoded.model is not None and decoded.model.name == expected
    assert isinstance(decoded.reply_format, oip.OipCall) is oip_call


def test_an_unknown_model_is_a_dead_letter_with_no_model_and_an_oip_caller_gets_oips_error_body():
    decoder = RequestDecoder("replies", 10_000, router=ROUTER)
    plain = decoder.decode(FakeRecord(b'{"text": "hi"}', headers=[(MODEL, b"gpt")]))
    assert plain.error.code == ErrorCode.MODEL_NOT_FOUND and plain.dead_letter and plain.model is None
    assert "gpt" in plain.error.message and "minilm, resnet" in plain.error.message
    called = decoder.decode(FakeRecord(b'{"inputs": []}', headers=[(oip.MODEL_HEADER, b"gpt")]))
    assert called.error.code == ErrorCode.MODEL_NOT_FOUND
    assert orjson.loads(called.reply_format.error(called.error.code, called.error.message)) == {
        "error": called.error.message}


def test_models_config_derives_each_models_settings_from_the_services():
    config = load_config({"request_topics": "texts,images", "max_batch_size": "16", "models": orjson.dumps([
        {"name": "minilm", "version": "2", "handler": "embedding"},
        {"name": "resnet", "handler": "image-classification", "request_topics": ["images"], "max_batch_size": 4,
         "micro_batch_size": 2, "parallelism": {"preprocess": 3}, "max_batch_tokens": 0},
    ]).decode()})
    first, second = config.model_configs()
    assert (first.model_name, first.model_version, first.handler, first.batching.max_batch_size) == (
        "minilm", "2", "embedding", 16)
    own = second.batching
    assert (second.model_name, own.max_batch_size, own.micro_batch_size) == ("resnet", 4, 2)
    assert (own.parallelism.preprocess, own.parallelism.inference, own.max_batch_tokens) == (3, 1, None)
    assert config.model_topics() == {"images": "resnet"}
    assert load_config().model_configs() == [load_config()]  # no models: the one the flags describe


@pytest.mark.parametrize(("models", "says"), [
    ([{"name": "a"}, {"name": "a"}], "model names must be distinct"),
    ([{"name": "a", "request_topics": ["elsewhere"]}], "'elsewhere' is not one of request_topics"),
    ([{"name": "a", "request_topics": ["texts"]}, {"name": "b", "request_topics": ["texts"]}], "mapped to two"),
    ([{"name": "a", "max_batch_size": 4, "micro_batch_size": 8}], "model a: config: Value error, micro_batch_size"),
    ([{"name": "a", "max_batch_size": 0}], "greater than or equal to 1"),
    ([{"name": "a b"}], "should match pattern"),
    ([{"name": "a", "hander": "echo"}], "Extra inputs are not permitted"),
])
def test_a_bad_models_list_fails_at_load_saying_what_is_wrong(models, says):
    with pytest.raises(ConfigError, match=None) as raised:
        load_config({"request_topics": "texts", "models": orjson.dumps(models).decode()})
    assert says in str(raised.value)


def test_with_models_the_single_model_flags_are_refused():
    with pytest.raises(ConfigError) as raised:
        load_config({"handler": "echo", "model_name": "x", "models": '[{"name": "a"}]'})
    assert "remove handler, model_name" in str(raised.value)


def test_kinference_model_takes_precedence_over_mlserver_model():
    """Issue 20, defect 9: with ``mlserver-model: e1`` and ``kinference-model: e2`` the request was told "model 'e1'
    is not served here" although e1 was served (the router took e2, OIP decoding then checked e1 against it)."""
    e1 = ModelRoute("e1", None, "json", oip.ServedModel("e1"))
    e2 = ModelRoute("e2", None, "json", oip.ServedModel("e2"))
    decoder = RequestDecoder("replies", 10_000, router=Router([e1, e2]))
    body = orjson.dumps({"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["hi"]}]})
    for headers in ([(oip.MODEL_HEADER, b"e1"), (MODEL, b"e2")], [(MODEL, b"e2"), (oip.MODEL_HEADER, b"e1")]):
        decoded = decoder.decode(FakeRecord(body, headers=headers))
        assert decoded.ok and decoded.model is e2 and decoded.payload == {"text": "hi"}
    assert oip.named_model([(oip.VERSION_HEADER, b"1"), (MODEL_VERSION, b"2"), (oip.MODEL_HEADER, b"a")]) == ("a", "2")
