"""Issue 36's generative findings, through a real ``kinference serve --handler generate``, on both paths: the engine
in the serving process, and the engine in the device process (``--device-process on``).

The served handler is ``generate`` with faults on cue (``tests/faults/generate_handlers.py``): a prompt with
``crash`` makes its step raise (transformers' loop dies), one with ``wedge`` makes its step hang for good; each new
engine takes 2 s more to build, so that the time the model is unhealthy can be seen. With ``max_sequences=1`` one
request at a time generates, so a request can be made to wait for the engine's place. Checks:

- prompts the engine cannot take (blank, whitespace-only, special tokens only, ``max_tokens`` 0 or past the
  context, a prompt past the context) are each refused alone with ``bad_request``; the engine serves on (today's
  main: ``{"prompt": " "}`` crashed its loop for good, and every later request failed);
- a step that raises fails the request it held (``handler_error``), the engine is replaced, ``/healthz`` is red
  and names it until the new one runs, and the requests sent meanwhile are served;
- a request whose deadline passes while it waits behind a hung step is answered ``deadline_exceeded`` at its
  deadline; the hung engine is replaced after ``--device-hang-s``, its request fails, and the next are served;
- the service never exits meanwhile, and stops cleanly (exit 0) at the end.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

import orjson
import pytest

from kinference.consumer.brokers.broker import free_port
from kinference.loadgen.client import Client
from kinference.loadgen.reply import Reply
from kinference.protocol import DEADLINE_MS, encode_deadline
from tests.conftest import FETCH_PROPERTIES
from tests.faults.harness import Member, now_ms
from tests.faults.test_workers import get, wait_until
from tests.models import build_tiny_causal_lm

pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.model]

HANG_S = 3.0
DEADLINE_S = 1.5
OPTIONS = ("decoding=greedy", "max_new_tokens=16", "max_sequences=1", "kv_cache_tokens=1024", "restart_delay_s=2")
REFUSED = [{"prompt": " "}, {"prompt": " \n\t "}, {"prompt": "[CLS] [SEP]"},
           {"messages": [{"role": "user", "content": "  "}]}, {"prompt": "the cat", "max_tokens": 0},
           {"prompt": "the cat", "max_tokens": 10_000}, {"prompt": "cat " * 300}]


class Health(threading.Thread):
    """``/healthz`` every 50 ms: (status, body) of each sample, in order."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.samples: list[tuple[int, bytes]] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(0.05):
            self.samples.append(get(self.port, "/healthz"))

    def red(self, fragment: bytes) -> list[bytes]:
        return [body for status, body in list(self.samples) if status == 503 and fragment in body]


def replies(futures: list[Future[Reply]]) -> list[Reply]:
    return [future.result(60) for future in futures]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("device_process", ["off", "on"])
def test_bad_prompts_a_dead_or_hung_engine_and_a_waiting_deadline(fault_settings, tmp_path, device_process: str):
    settings = fault_settings(partitions=1)
    model = build_tiny_causal_lm(tmp_path / "lm")
    port = free_port()
    args = [arg for arg in settings.args() if arg != "--no-metrics"]
    args[args.index("--handler") + 1] = "tests.faults.generate_handlers:FaultyGenerate"
    args += ["--model", str(model), "--metrics-host", "127.0.0.1", "--metrics-port", str(port),
             "--device-hang-s", str(HANG_S), "--device-process", device_process,
             *[arg for option in OPTIONS for arg in ("--handler-options", option)]]
    if device_process == "on":
        args += ["--workers", "1"]
    member = Member(f"generate-{device_process}", args)
    # The deadline is set on one request only (below): the others may wait out a restart.
    client = Client(settings.bootstrap, settings.topics["requests"], settings.topics["replies"], reply_partition=0,
                    timeout_s=90.0, propagate_deadline=False, reply_consumer=FETCH_PROPERTIES).start()
    health = Health(port)
    try:
        wait_until(lambda: get(port, "/readyz")[0] == 200, 120, "the service ready", member)
        health.start()

        # 1. Each refused alone at validate; the engine serves on.
        refused = replies([client.send(body) for body in REFUSED])
        assert [reply.error_code for reply in refused] == ["bad_request"] * len(REFUSED), [
            reply.value for reply in refused]
        assert completion(client.request({"prompt": "the cat sat", "max_tokens": 8}))

        # 2. A step that raises: its request fails, the engine is replaced, what comes meanwhile is served.
        crash = client.send({"prompt": "crash now", "max_tokens": 8})
        wait_until(lambda: health.red(b"engine is being replaced"), 30, "/healthz red while replaced", member)
        meanwhile = [client.send({"prompt": f"the cat {i}", "max_tokens": 8}) for i in range(3)]
        assert crash.result(60).error_code == "handler_error"
        assert all(completion(reply) for reply in replies(meanwhile))
        wait_until(lambda: health.samples[-1][0] == 200, 30, "/healthz green again", member)

        # 3. A hung step holds the engine's one place; a request behind it with a deadline is answered at it.
        wedge = client.send({"prompt": "wedge it", "max_tokens": 8})
        time.sleep(0.5)  # the wedge holds the place
        deadline_ms = now_ms() + int(DEADLINE_S * 1000)
        late = client.send({"prompt": "the cat", "max_tokens": 8},
                           headers=[(DEADLINE_MS, encode_deadline(deadline_ms))]).result(60)
        assert late.error_code == "deadline_exceeded", late.value
        late_by_ms = time.time() * 1000 - deadline_ms
        assert late_by_ms < 1500, late_by_ms
        failed = wedge.result(60)
        assert failed.error_code == "handler_error" and b"no decoding step" in (failed.value or b""), failed.value
        assert completion(client.request({"prompt": "the cat sat", "max_tokens": 8}))
        wait_until(lambda: health.samples[-1][0] == 200, 30, "/healthz green again", member)
        assert len(health.red(b"no decoding step")) >= 1

        assert member.running, member.tail()
        member.terminate()
        assert member.wait_exit(60) == 0, member.tail()
    finally:
        health.stopping.set()
        client.close()
        member.kill()


def completion(reply: Reply) -> dict[str, Any]:
    assert reply.ok, reply.value
    body: dict[str, Any] = orjson.loads(reply.value or b"{}")
    assert body["object"] == "chat.completion", body
    return body
