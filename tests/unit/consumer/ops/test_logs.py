import logging

import orjson

from kinference.consumer.ops.logs import JsonFormatter, TextFormatter, about
from tests.fakes import make_request


def record(**extra) -> logging.LogRecord:
    entry = logging.LogRecord("kinference.test", logging.WARNING, __file__, 1, "reply failed: %s", ("boom",), None)
    entry.__dict__.update(extra)
    return entry


def test_json_lines_carry_the_request_coordinates():
    request = make_request(topic="requests", partition=2, offset=41)
    line = orjson.loads(JsonFormatter().format(record(**about(request))))
    assert line["message"] == "reply failed: boom" and line["level"] == "WARNING"
    assert (line["topic"], line["partition"], line["offset"], line["correlation_id"]) == ("requests", 2, 41, "c41")


def test_lines_about_no_request_have_no_coordinates():
    line = orjson.loads(JsonFormatter().format(record()))
    assert "topic" not in line and line["logger"] == "kinference.test"


def test_text_lines_append_the_coordinates():
    request = make_request(topic="requests", partition=2, offset=41)
    assert TextFormatter().format(record(**about(request))).endswith("[requests/2/41 correlation c41]")
