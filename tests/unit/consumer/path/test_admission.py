"""A model's admission (consumer/path/admission.py), the first step of its runner's ``put``: a fetch's requests are
validated, priced and refused past the model's share, then queued in one call, or answered."""

from __future__ import annotations

from kinference.consumer.path.admission import Admission
from kinference.errors import InvalidInput
from kinference.handlers.echo import EchoHandler
from tests.fakes import make_request


class Positive(EchoHandler):
    def validate(self, payload):
        if payload < 0:
            raise InvalidInput("negative")
        return payload

    def cost(self, item):
        return item


def test_a_fetch_is_queued_in_one_call_past_the_refused_and_each_keeps_its_own_outcome():
    answered, queued = [], []
    admission = Admission("m", Positive(), answered.extend, max_in_flight=3)
    requests = [make_request(value) for value in (1, -1, 2, 3, 4)]
    admission.put(requests, 1, queued.append)  # the model holds 1 of its 3: room for two
    assert [[request.payload for request in batch] for batch in queued] == [[1, 2]]
    assert [(request.item, request.tokens) for request in queued[0]] == [(1, 1), (2, 2)]
    assert [(requests.index(request), request.error.code) for request in answered] == [
        (1, "bad_request"), (3, "overloaded"), (4, "overloaded")]
    assert "3 of its requests are in flight" in answered[1].error.message
    # Answered at once, so their decoded values go now, not when the broker has their answers (an outage).
    assert all(request.payload is None and request.item is None for request in answered)


def test_a_queue_that_fails_fails_only_the_request_it_cannot_take():
    """A bug where requests are queued (the intake's routing guard before the fetch went in one call): its
    neighbours are queued alone, and the request that breaks it is answered internal_error, never left in flight."""
    answered, queued = [], []

    def queue(requests):
        if any(request.payload == 2 for request in requests):
            raise RuntimeError("routing bug")
        queued.extend(requests)

    requests = [make_request(value) for value in (1, 2, 3)]
    Admission("m", Positive(), answered.extend).put(requests, 0, queue)
    assert [request.payload for request in queued] == [1, 3]
    assert [(requests.index(request), request.error.code) for request in answered] == [(1, "internal_error")]
    assert "routing bug" in answered[0].error.message
