"""``kinference serve --device-process on --workers 2``: a supervisor, one device process that runs the model for
both workers, on the real broker (CPU: the same design as on a GPU).

Every request is answered by the one device process; a device process killed with SIGKILL is started again and
the workers send their calls again, so nothing is lost; ``/healthz`` and ``/metrics`` name the device process."""

from __future__ import annotations

import contextlib
import os
import re
import signal

import orjson
import pytest

from kinference.consumer.broker import free_port
from tests.faults.harness import Member, client_for
from tests.faults.test_workers import get, sample, wait_until

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


@pytest.mark.timeout(240)
def test_one_device_process_serves_both_workers_and_a_killed_one_loses_nothing(fault_settings):
    settings = fault_settings(partitions=4, assignor="range")
    port = free_port()
    args = [arg for arg in settings.args() if arg != "--no-metrics"]
    args[args.index("--handler") + 1] = "tests.faults.handlers:DeviceEcho"
    supervisor = Member("supervisor", [*args, "--device-process", "on", "--workers", "2", "--metrics-host",
                                       "127.0.0.1", "--metrics-port", str(port)])
    client = client_for(settings).start()
    try:
        wait_until(lambda: get(port, "/readyz")[0] == 200 and "worker 1" in pids(supervisor), 90,
                   "the device process and both workers ready", supervisor)
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

        supervisor.terminate()
        assert supervisor.wait_exit(40) == 0
        for pid in pids(supervisor).values():
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        client.close()
        if supervisor.running:  # a failed test: its children may run on
            for pid in pids(supervisor).values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        supervisor.kill()
