"""The supervisor of ``--workers N`` with stand-in worker processes (small Python scripts, no broker)."""

from __future__ import annotations

import signal
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import orjson
import pytest
from prometheus_client import CollectorRegistry

from kinference.consumer.endpoints import Endpoints, EndpointSettings
from kinference.consumer.supervisor import Restarts, Supervisor
from tests.fakes import wait_for

# A worker that reports what its argv says and runs until SIGTERM (exit 0) or SIGINT (exit 5).
_WORKER = """
import os, signal, sys, time
import orjson
report, healthy = sys.argv[1], sys.argv[2] == "healthy"
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
signal.signal(signal.SIGINT, lambda *_: sys.exit(5))
body = {"pid": os.getpid(), "health": {"source": True, "stages": healthy}, "ready": {"group_joined": True},
        "problems": [] if healthy else ["stages: the inference thread died"]}
open(report + ".tmp", "wb").write(orjson.dumps(body)); os.replace(report + ".tmp", report)
while True:
    time.sleep(0.1)
"""


def test_a_worker_that_keeps_dying_stops_the_supervisor_with_exit_code_1(tmp_path: Path):
    supervisor = Supervisor(2, lambda report: [sys.executable, "-c", "import sys; sys.exit(3)"], grace_s=1,
                            metrics_dir=tmp_path, restarts=Restarts(backoff_s=(0.01, 0.05), quick_deaths=3))
    assert supervisor.run() == 1
    assert max(worker.restarts for worker in supervisor.workers) == 2  # started 3 times, then given up on
    # The worker given up on exited 3 each time; the other may have been stopped first (the supervisor then stops
    # every worker), so only one is certain to have died of itself (a CI run saw the other end by SIGTERM).
    assert any(worker.last_exit == 3 and worker.restarts == 2 for worker in supervisor.workers)


def test_health_names_the_unhealthy_worker_and_a_signal_reaches_every_worker(tmp_path: Path):
    def command(report: Path) -> list[str]:
        return [sys.executable, "-c", _WORKER, str(report), "healthy" if report.name == "worker-0.json" else "sick"]

    supervisor = Supervisor(2, command, grace_s=5, metrics_dir=tmp_path / "metrics")
    exit_code: list[int] = []
    runner = threading.Thread(target=lambda: exit_code.append(supervisor.run()))
    runner.start()
    try:
        assert wait_for(lambda: "starting" not in str(supervisor.problems()), timeout_s=10)
        assert supervisor.health_checks() == {"worker 0": True, "worker 1": False}
        endpoints = Endpoints(EndpointSettings("127.0.0.1", 0), CollectorRegistry(), supervisor.health_checks,
                              supervisor.readiness_checks, supervisor.problems).start()
        try:
            with pytest.raises(urllib.error.HTTPError) as answered:
                urllib.request.urlopen(f"http://127.0.0.1:{endpoints.port}/healthz", timeout=5)
        finally:
            endpoints.close()
        answer = orjson.loads(answered.value.read())
        assert answered.value.code == 503 and list(answer["problems"]) == ["worker 1"]
        assert "stages" in answer["problems"]["worker 1"] and "inference thread died" in answer["problems"]["worker 1"]
        assert supervisor.readiness_checks() == {"worker 0": True, "worker 1": True}
    finally:
        supervisor.stop(signal.SIGINT)
        runner.join(15)
    assert exit_code == [0]
    assert [worker.last_exit for worker in supervisor.workers] == [5, 5]  # SIGINT itself reached them


def test_a_worker_that_died_is_started_again(tmp_path: Path):
    flag = tmp_path / "died-once"

    def command(report: Path) -> list[str]:
        # The first start exits at once; the next one runs like a worker.
        script = (f"import pathlib, sys\np = pathlib.Path({str(flag)!r})\n"
                  "if not p.exists():\n    p.touch(); sys.exit(1)\n")
        return [sys.executable, "-c", script + _WORKER, str(report), "healthy"]

    supervisor = Supervisor(1, command, grace_s=5, metrics_dir=tmp_path / "metrics",
                            restarts=Restarts(backoff_s=(0.05, 0.1)))
    runner = threading.Thread(target=supervisor.run)
    runner.start()
    try:
        assert wait_for(lambda: supervisor.workers[0].restarts == 1 and supervisor.health_checks()["worker 0"]
                        and not supervisor.problems(), timeout_s=10)
        assert supervisor.workers[0].last_exit == 1
    finally:
        supervisor.stop()
        runner.join(15)
