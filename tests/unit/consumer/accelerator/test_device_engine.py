"""A generative model's engine in the device process, fed by several workers' links, in one test process: each
worker's events come back to it alone, a worker that leaves has its sequences cancelled, and a device process that
restarts (or stays away) ends the link's requests as ``lost`` (or ``error``)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kinference.consumer.accelerator.device_engine import DeviceEngine
from kinference.consumer.accelerator.device_server import DeviceBatching, DeviceMetrics, DeviceServer
from kinference.consumer.accelerator.wire import FRAGMENT_BYTES
from kinference.consumer.accelerator.worker_engine_link import EngineLink
from kinference.consumer.accelerator.worker_link import DeviceUnavailable
from kinference.handlers.generative import Event, Prompt, Sampling
from tests.fakes import wait_for
from tests.unit.consumer.path.test_generations import ScriptedEngine

PROMPT = Prompt((1, 2, 3), Sampling(8), stream=True)


class RefusingEngine(ScriptedEngine):
    """Refuses a prompt of one token, as an engine that is not running refuses every prompt."""

    def submit(self, request_id: str, prompt: Prompt) -> None:
        if len(prompt.token_ids) == 1:
            raise RuntimeError("no room")
        super().submit(request_id, prompt)


def _server(path: Path, engine: ScriptedEngine) -> DeviceServer:
    return DeviceServer({}, path, DeviceBatching(8), DeviceMetrics(0, CollectorRegistry()),
                        {"lm": DeviceEngine("lm", engine)}).start()


def _link(path: Path, wait_s: float = 10.0) -> EngineLink:
    link = EngineLink(path, "lm", wait_s)
    link.connect()
    return link


def _collect(link: EngineLink, until: int, timeout_s: float = 10.0) -> list[Event]:
    """The link's events until ``until`` of them came (or the timeout)."""
    events: list[Event] = []
    deadline = time.monotonic() + timeout_s
    while len(events) < until and time.monotonic() < deadline:
        events += link.events(0.05)
    return events


def test_each_workers_events_come_back_to_it_under_its_own_ids(tmp_path: Path) -> None:
    engine = RefusingEngine()
    server = _server(tmp_path / "d.sock", engine)
    first, second = _link(server.path), _link(server.path)
    try:
        # Both workers use the same id: the engine sees two requests, one per connection.
        first.submit("r", PROMPT)
        second.submit("r", PROMPT)
        long = Prompt(tuple(range(3 * FRAGMENT_BYTES // 4)), Sampling(8))  # a message of several packets
        second.submit("long", long)
        assert wait_for(lambda: len(engine.submitted) == 3)
        # Each connection's ids under its own prefix (the first connected is 0: it had its "ok" before the second).
        one, two = "0/r", "1/r"
        assert sorted(engine.submitted) == [one, "1/long", two]
        engine.step(one, "hello", final=True)
        engine.step(two, "other")
        assert _collect(first, 2) == [Event("r", "delta", "hello", 1, 3), Event("r", "final", "hello", 1, 3, "stop")]
        assert _collect(second, 1) == [Event("r", "delta", "other", 1, 3)]
        second.cancel("r")
        assert _collect(second, 1) == [Event("r", "cancelled")] and engine.cancelled == [two]
        # The engine's refusal is that request's error; the others go on.
        first.submit("bad", Prompt((7,), Sampling(8)))
        (refused,) = _collect(first, 1)
        assert refused.request_id == "bad" and refused.kind == "error" and "no room" in refused.text
    finally:
        first.close()
        second.close()
        server.stop(5)


def test_a_worker_that_leaves_has_its_sequences_cancelled(tmp_path: Path) -> None:
    engine = ScriptedEngine()
    server = _server(tmp_path / "d.sock", engine)
    leaving, staying = _link(server.path), _link(server.path)
    try:
        leaving.submit("a", PROMPT)
        leaving.submit("b", PROMPT)
        staying.submit("c", PROMPT)
        assert wait_for(lambda: len(engine.submitted) == 3)
        leaving.close()
        assert wait_for(lambda: sorted(engine.cancelled) == ["0/a", "0/b"])
        engine.step("1/c", "still here", final=True)
        assert [event.kind for event in _collect(staying, 2)] == ["delta", "final"]
    finally:
        staying.close()
        server.stop(5)


def test_a_restarted_device_process_ends_what_the_old_one_held_as_lost(tmp_path: Path) -> None:
    path = tmp_path / "d.sock"
    server = _server(path, ScriptedEngine())
    link = _link(path)
    try:
        link.submit("running", PROMPT)
        server.stop(5)  # the device process dies: its connections close
        link.submit("while-down", PROMPT)  # handed over while none is up
        assert link.events(0.2) == [] and link.events(0.2) == []
        engine = ScriptedEngine()
        server = _server(path, engine)
        lost = _collect(link, 2)
        assert sorted(lost, key=lambda event: event.request_id) == [Event("running", "lost"),
                                                                    Event("while-down", "lost")]
        link.submit("again", PROMPT)  # the new device process serves the next attempt
        assert wait_for(lambda: len(engine.submitted) == 1)
        engine.step(engine.submitted[0], "done", final=True)
        assert [event.kind for event in _collect(link, 2)] == ["delta", "final"]
    finally:
        link.close()
        server.stop(5)


def test_requests_fail_when_no_device_process_comes_back_within_the_wait(tmp_path: Path) -> None:
    path = tmp_path / "d.sock"
    server = _server(path, ScriptedEngine())
    link = _link(path, wait_s=0.5)
    try:
        link.submit("r", PROMPT)
        server.stop(5)
        (failed,) = _collect(link, 1)
        assert failed.request_id == "r" and failed.kind == "error" and "0.5 s" in failed.text
    finally:
        link.close()
    with pytest.raises(DeviceUnavailable, match="model lm"):
        EngineLink(path, "lm", wait_s=0.3).connect()


def test_a_link_to_a_model_the_device_process_does_not_generate_waits_then_says_so(tmp_path: Path) -> None:
    server = _server(tmp_path / "d.sock", ScriptedEngine())
    try:
        with pytest.raises(DeviceUnavailable, match="model other"):
            EngineLink(server.path, "other", wait_s=0.3).connect()
    finally:
        server.stop(5)


class WedgingEngine(ScriptedEngine):
    """Its ``events`` call never comes back once ``wedge`` is set (a wedged model call), until ``release``."""

    def __init__(self) -> None:
        super().__init__()
        self.wedge = threading.Event()
        self.release = threading.Event()

    def events(self, timeout_s: float) -> list[Event]:
        if self.wedge.is_set():
            self.release.wait(30)
        return super().events(timeout_s)


def test_an_engine_that_stops_stepping_ends_what_it_holds_and_reports_the_process_hung(tmp_path: Path) -> None:
    engine = WedgingEngine()
    server = DeviceServer({}, tmp_path / "d.sock", DeviceBatching(8, hang_s=0.5), DeviceMetrics(0, CollectorRegistry()),
                          {"lm": DeviceEngine("lm", engine)}).start()
    link = _link(server.path)
    try:
        link.submit("r", PROMPT)
        assert wait_for(lambda: engine.submitted == ["0/r"])
        time.sleep(1)  # idle with a request: the pump still comes back every poll
        assert server.hung is None
        engine.wedge.set()
        (failed,) = _collect(link, 1)
        assert failed.request_id == "r" and failed.kind == "error" and "device_hung" in failed.text
        assert wait_for(lambda: server.hung is not None) and "has not stepped" in str(server.hung)
    finally:
        engine.release.set()
        link.close()
        server.stop(5)
