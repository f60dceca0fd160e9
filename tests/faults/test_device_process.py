"""``kinference serve --device-process on --workers 2``: a supervisor, one device process that runs the model for
both workers, on the real broker (CPU: the same design as on a GPU).

Every request is answered by the one device process; a device process killed with SIGKILL is started again and
the workers send their calls again, so nothing is lost; ``/healthz`` and ``/metrics`` name the device process.
The same for a generative model, whose one engine in the device process generates for both workers. What the
in-process path answers, this one answers too: OpenAI embeddings bodies with an ``input`` list, micro-batches of
megabytes; a device batch that hangs is answered ``device_hung`` and its process replaced; a SIGTERM to the whole
process group drains as one to the supervisor does."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator

import orjson
import pytest

from kinference import protocol
from kinference.consumer.brokers.broker import free_port
from kinference.loadgen.stream import Stream
from tests.faults.harness import Load, Member, client_for, read_all
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
def supervised(settings, handler: str | None, *extra: str, own_group: bool = False) -> Iterator[tuple[Member, int]]:
    """``kinference serve --device-process on --workers 2`` serving ``handler`` (None: no ``--handler``, for
    ``--models``), ready (the device process and both workers); its metrics port. Every process of it is killed at
    the end if a failed test left them running. ``own_group``: the supervisor and its processes in a process group of
    their own (``Member``)."""
    port = free_port()
    args = [arg for arg in settings.args() if arg != "--no-metrics"]
    at = args.index("--handler")
    args[at:at + 2] = [] if handler is None else ["--handler", handler]
    supervisor = Member("supervisor", [*args, "--device-process", "on", "--workers", "2", "--metrics-host",
                                       "127.0.0.1", "--metrics-port", str(port), *extra], own_group=own_group)
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


@pytest.mark.model
@pytest.mark.timeout(240)
def test_openai_embeddings_input_lists_and_their_neighbours_are_answered_as_in_process(fault_settings):
    """Three ``{"input": [...]}`` bodies among 30 single texts, sent together so that they share micro-batches and
    device batches: each list takes a row per text, and every request is answered, each text with the embedding its
    single request got."""
    from tests.models import varied_texts

    settings = fault_settings(partitions=2)
    texts = varied_texts(30, max_words=20)
    client = client_for(settings).start()
    try:
        with supervised(settings, "embedding", "--device-batch-size", "64"):
            singles, lists = [], []
            for index, text in enumerate(texts):
                singles.append(client.send({"text": text}, key=str(index)))
                if index % 10 == 4:
                    lists.append(client.send({"input": [texts[index], texts[index - 1], texts[index - 2]]},
                                             key=f"list-{index}"))
            single = [future.result(60) for future in singles]
            listed = [future.result(60) for future in lists]
    finally:
        client.close()
    assert [reply.error_code for reply in single + listed if not reply.ok] == []
    for reply, index in zip(listed, (4, 14, 24), strict=True):
        body = reply.result()
        assert body["object"] == "list" and [entry["index"] for entry in body["data"]] == [0, 1, 2]
        for entry, row in zip(body["data"], (index, index - 1, index - 2), strict=True):
            assert entry["embedding"] == pytest.approx(single[row].result()["embedding"], abs=1e-4)


@pytest.mark.timeout(240)
def test_micro_batches_of_megabytes_cross_the_device_link_as_small_ones_do(fault_settings):
    """32 requests of 128 KiB, echoed: micro-batches whose call and reply are megabytes each (4 MiB for a micro-batch
    of all 32), far past a socket message's limit (~208 KiB), are answered at once."""
    settings = fault_settings(partitions=1)
    client = client_for(settings).start()
    pad = "x" * (128 << 10)
    try:
        with supervised(settings, "tests.faults.handlers:DeviceEcho", "--max-batch-size", "32",
                        "--micro-batch-size", "32") as (supervisor, port):
            started = time.monotonic()
            futures = [client.send({"seq": seq, "pad": pad}, key=str(seq)) for seq in range(32)]
            replies = [future.result(60) for future in futures]
            elapsed = time.monotonic() - started
            assert [reply.error_code for reply in replies if not reply.ok] == []
            assert [reply.result()["value"]["seq"] for reply in replies] == list(range(32))
            assert all(reply.result()["value"]["pad"] == pad for reply in replies)
            assert elapsed < 15, f"{elapsed:.1f} s"
            assert sample(get(port, "/metrics")[1], "kinference_device_batch_rows_sum", device="0") >= 32
            stop_cleanly(supervisor)
    finally:
        client.close()


def _healthz(port: int) -> tuple[int, dict]:
    status, body = get(port, "/healthz")
    return status, orjson.loads(body) if body else {}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_hung_device_batch_is_answered_device_hung_and_its_process_replaced_while_the_rest_flow(fault_settings):
    """A request whose device batch never returns (a wedged model call), among a steady load: within
    ``--device-hang-s`` its batch is answered ``device_hung``, ``/healthz`` turns red naming the device process, which
    is killed and started again; every other request is answered ok, and ``/healthz`` is green again."""
    settings = fault_settings(partitions=2)
    client = client_for(settings).start()
    try:
        with supervised(settings, "tests.faults.handlers:DeviceWedge", "--device-hang-s", "3") as (supervisor, port):
            first = pids(supervisor)["device 0"]
            load = Load(client, rate=40, count=400).start()
            time.sleep(1)
            wedged = client.send({"wedge": True}, key="wedge")
            health: list[tuple[float, int, dict]] = []
            sent = time.monotonic()
            while time.monotonic() - sent < 30:  # until it was red and is green again
                status, body = _healthz(port)
                health.append((time.monotonic() - sent, status, body))
                if status == 200 and any(seen != 200 for _, seen, _ in health):
                    break
                time.sleep(0.25)
            reply = wedged.result(30)
            wait_until(lambda: len(load.futures) == 400, 30, "the whole load sent (10 s)", supervisor)
            replies = [future.result(60) for future in load.futures]
            assert pids(supervisor)["device 0"] != first
            stop_cleanly(supervisor)
    finally:
        client.close()
    assert reply.error_code == "device_hung" and "--device-hang-s" in reply.json()["error"]["message"]
    codes = Counter(r.error_code for r in replies if not r.ok)
    # Only requests that shared the wedged device batch fail, and with device_hung; nothing is lost.
    assert set(codes) <= {"device_hung"} and sum(codes.values()) < 10, codes
    assert len(replies) == 400 and health[-1][1] == 200
    red = [(at, body) for at, status, body in health if status != 200]
    assert red, "no red /healthz while the device process was hung"
    assert red[0][0] < 3 + 2, red[0]  # as the hang is detected (3 s after the batch began, and a poll)
    assert any("device 0" in str(body) for _, body in red), red


@pytest.mark.timeout(240)
def test_a_sigterm_to_the_whole_process_group_drains_as_one_to_the_supervisor(fault_settings):
    """systemd's ``KillMode=control-group`` signals every process of the unit at once: the device process serves
    on until the workers have drained, so the stop abandons nothing, and ends as fast as a SIGTERM to the supervisor
    alone."""
    settings = fault_settings(partitions=2)
    client = client_for(settings).start()
    try:
        with supervised(settings, "tests.faults.handlers:DeviceEcho", "--handler-options", "delay_s=0.2",
                        own_group=True) as (supervisor, _port):
            children = pids(supervisor)
            futures = [client.send({"seq": seq}, key=str(seq)) for seq in range(300)]
            wait_until(lambda: sum(future.done() for future in futures) >= 20, 60, "the first answers", supervisor)
            started = time.monotonic()
            os.killpg(supervisor.pid, signal.SIGTERM)
            assert supervisor.wait_exit(40) == 0
            elapsed = time.monotonic() - started
    finally:
        client.close()
    for pid in children.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not supervisor.said("still in flight"), supervisor.tail(60)
    assert not supervisor.said("did not stop in time"), supervisor.tail(60)
    assert elapsed < 20, f"{elapsed:.1f} s"
