"""``kinference serve --device-process on --workers 2``: a supervisor, one device process that runs the model for
both workers, on the real broker (CPU: the same design as on a GPU).

Every request is answered by the one device process; a device process killed with SIGKILL is started again and
the workers send their calls again, so nothing is lost; ``/healthz`` and ``/metrics`` name the device process.
The same for a generative model, whose one engine in the device process generates for both workers."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
from collections import Counter
from collections.abc import Iterator

import orjson
import pytest

from kinference import protocol
from kinference.consumer.brokers.broker import free_port
from kinference.loadgen.stream import Stream
from tests.faults.harness import Member, client_for, read_all
from tests.faults.test_workers import get, sample, wait_until
from tests.integration.kafka_io import headers_of
from tests.models import build_tiny_causal_lm

pytestmark = [pytest.mark.integration, pytest.mark.faults]

_STARTED = re.compile(r"^(worker|device) (\d) started \(pid (\d+)\)")


def pids(supervisor: Member) -> dict[str, int]:
    """The latest pid of each process ("worker 0", "device 0"...), from the supervisor's log."""
    found = {}
    for message in list(supervisor.messages):
        if match := _STARTED.match(message.get("message", "")):
            found[f"{match.group(1)} {match.group(2)}"] = int(match.group(3))
    return found


def device_pids(client, start: int, count: int) -> list[int]:
    """Send ``count`` requests; the device pid of each answer (all must be answered ok)."""
    futures = [client.send({"seq": seq}, key=str(seq)) for seq in range(start, start + count)]
    replies = [future.result(60) for future in futures]
    assert all(reply.ok for reply in replies), [reply.error_code for reply in replies if not reply.ok]
    return [reply.result()["device_pid"] for reply in replies]


@contextlib.contextmanager
def supervised(settings, handler: str | None, *extra: str) -> Iterator[tuple[Member, int]]:
    """``kinference serve --device-process on --workers 2`` serving ``handler`` (None: no ``--handler``, for
    ``--models``), ready (the device process and both workers); its metrics port. Every process of it is killed at
    the end if a failed test left them running."""
    port = free_port()
    args = [arg for arg in settings.args() if arg != "--no-metrics"]
    at = args.index("--handler")
    args[at:at + 2] = [] if handler is None else ["--handler", handler]
    supervisor = Member("supervisor", [*args, "--device-process", "on", "--workers", "2", "--metrics-host",
                                       "127.0.0.1", "--metrics-port", str(port), *extra])
    try:
        wait_until(lambda: get(port, "/readyz")[0] == 200 and "worker 1" in pids(supervisor), 90,
                   "the device process and both workers ready", supervisor)
        yield supervisor, port
    finally:
        if supervisor.running:  # a failed test: its children may run on
            for pid in pids(supervisor).values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        supervisor.kill()


def stop_cleanly(supervisor: Member) -> None:
    """SIGTERM: the supervisor and every process of it end, exit code 0."""
    supervisor.terminate()
    assert supervisor.wait_exit(40) == 0
    for pid in pids(supervisor).values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.timeout(240)
def test_one_device_process_serves_both_workers_and_a_killed_one_loses_nothing(fault_settings):
    settings = fault_settings(partitions=4, assignor="range")
    client = client_for(settings).start()
    try:
        with supervised(settings, "tests.faults.handlers:DeviceEcho") as (supervisor, port):
            status, body = get(port, "/healthz")
            assert status == 200 and orjson.loads(body)["checks"] == {"device 0": True, "worker 0": True,
                                                                     "worker 1": True}
            first = pids(supervisor)["device 0"]
            assert set(device_pids(client, 0, 40)) == {first}  # one copy of the model for both workers

            os.kill(first, signal.SIGKILL)
            # Sent while the device process is down or starting: the workers hold the calls and send them again.
            assert set(device_pids(client, 40, 40)) <= {first, pids(supervisor)["device 0"]}
            wait_until(lambda: pids(supervisor)["device 0"] != first, 30, "device 0 started again", supervisor)
            second = pids(supervisor)["device 0"]
            assert set(device_pids(client, 80, 20)) == {second}

            metrics = get(port, "/metrics")[1]
            assert sample(metrics, "kinference_device_process_restarts_total", device="0") == 1
            assert sample(metrics, "kinference_workers") == 2
            assert sample(metrics, "kinference_device_batch_rows_count", device="0") > 0
            assert sample(metrics, "kinference_requests_total", outcome="ok") >= 100
            stop_cleanly(supervisor)
    finally:
        client.close()


class Reader(threading.Thread):
    """Reads one ``Client.stream`` to its end: the deltas (the text of the last attempt), restarts and outcome."""

    def __init__(self, stream: Stream) -> None:
        super().__init__(daemon=True)
        self.stream = stream
        self.text = ""
        self.deltas = 0
        self.restarts = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for delta in self.stream:
                if delta.restart:
                    self.restarts += 1
                    self.text = ""
                self.text += delta.text
                self.deltas += 1
        except BaseException as exc:  # the test reads it
            self.error = exc


@pytest.mark.timeout(300)
def test_one_engine_generates_for_both_workers_and_a_killed_device_process_ends_no_request_twice(fault_settings,
                                                                                               tmp_path):
    """A generative model's engine runs once, in the device process, for both workers; SIGKILLed mid-generation,
    it is started again and each worker generates what it had there again, under a new attempt: every request
    still ends with exactly one final, whose text is what a greedy generation of its prompt gives."""
    settings = fault_settings(partitions=4, assignor="range")
    model = build_tiny_causal_lm(tmp_path / "lm")
    client = client_for(settings).start()
    count = 16
    try:
        with supervised(settings, "generate", "--model", str(model), "--stream-every-tokens", "4",
                        *[arg for option in ("decoding=greedy", "max_new_tokens=160", "kv_cache_tokens=4096")
                          for arg in ("--handler-options", option)]) as (supervisor, port):
            first = pids(supervisor)["device 0"]
            readers = [Reader(client.stream({"prompt": f"kafka topic {seq % 4}", "max_tokens": 160}, key=str(seq),
                                            timeout_s=120)) for seq in range(count)]
            for reader in readers:
                reader.start()
            wait_until(lambda: sum(reader.deltas for reader in readers) >= count, 60, "chunks of the generations",
                       supervisor)
            os.kill(first, signal.SIGKILL)
            for reader in readers:
                reader.join(150)
            assert [reader.error for reader in readers] == [None] * count
            wait_until(lambda: pids(supervisor)["device 0"] != first, 30, "device 0 started again", supervisor)
            metrics = get(port, "/metrics")[1]
            assert sample(metrics, "kinference_device_process_restarts_total", device="0") == 1
            stop_cleanly(supervisor)
    finally:
        client.close()
    # The kill came mid-generation: some requests were generated again, and what a client accepts is the text of
    # one greedy generation of its prompt (not the lost attempt's with the new one's after it).
    assert any(reader.restarts for reader in readers)
    texts: dict[str, set[str]] = {}
    for seq, reader in enumerate(readers):
        completion = reader.stream.completion
        assert completion is not None and completion["choices"][0]["message"]["content"] == reader.text
        texts.setdefault(f"kafka topic {seq % 4}", set()).add(reader.text)
    assert all(len(variants) == 1 for variants in texts.values()), texts
    # Exactly one final per request on the reply topic: none was answered twice, none lost.
    finals = Counter(headers_of(record)[protocol.CORRELATION_ID]
                     for record in read_all(settings.bootstrap, settings.topics["replies"], count, 30)
                     if headers_of(record)[protocol.EVENT] == b"final")
    assert sorted(finals.values()) == [1] * count and {r.stream.correlation_id.encode() for r in readers} == set(finals)
