"""The supervisor of ``--workers N`` with stand-in worker processes (small Python scripts, no broker)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request
from pathlib import Path

import orjson
import pytest
from prometheus_client import CollectorRegistry

from kinference.consumer.ops.endpoints import Endpoints, EndpointSettings
from kinference.consumer.ops.supervisor import Member, Restarts, Supervisor
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
    supervisor = Supervisor(2, lambda member: [sys.executable, "-c", "import sys; sys.exit(3)"], grace_s=1,
                            metrics_dir=tmp_path, restarts=Restarts(backoff_s=(0.01, 0.05), quick_deaths=3))
    assert supervisor.run() == 1
    assert max(worker.restarts for worker in supervisor.workers) == 2  # started 3 times, then given up on
    # The worker given up on exited 3 each time; the other may have been stopped first (the supervisor then stops
    # every worker), so only one is certain to have died of itself (a CI run saw the other end by SIGTERM).
    assert any(worker.last_exit == 3 and worker.restarts == 2 for worker in supervisor.workers)


def test_health_names_the_unhealthy_worker_and_a_signal_reaches_every_worker(tmp_path: Path):
    def command(member: Member) -> list[str]:
        report = member.report
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

    def command(member: Member) -> list[str]:
        # The first start exits at once; the next one runs like a worker.
        script = (f"import pathlib, sys\np = pathlib.Path({str(flag)!r})\n"
                  "if not p.exists():\n    p.touch(); sys.exit(1)\n")
        return [sys.executable, "-c", script + _WORKER, str(member.report), "healthy"]

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


# A supervisor in a process of its own, started by the test so that the test can SIGKILL it. Its workers call what a
# worker of `serve --workers N` calls first, write their pid, and run until SIGTERM (exit 0).
_SUPERVISOR = """
import sys
from pathlib import Path
from kinference.consumer.ops.supervisor import Supervisor
worker = '''
import os, signal, sys, time
from pathlib import Path
from kinference.consumer.ops.supervisor import die_with_supervisor
die_with_supervisor()
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
Path(sys.argv[1]).with_suffix(".pid").write_text(str(os.getpid()))
while True:
    time.sleep(0.1)
'''
Supervisor(2, lambda report: [sys.executable, "-c", worker, str(Path(sys.argv[1]) / report.name)], grace_s=5).run()
"""


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie whose new parent has not reaped it yet does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_workers_die_with_a_killed_supervisor_and_its_directories_go_at_the_next_start(tmp_path: Path, monkeypatch):
    """Issue 29, item 3: a SIGKILLed supervisor left its workers serving as orphans (40 of 40 new requests answered
    by them) beside a restarted supervisor's, and its temporary directories behind."""
    pids, temporary = tmp_path / "pids", tmp_path / "tmp"
    pids.mkdir()
    temporary.mkdir()
    supervisor = subprocess.Popen([sys.executable, "-c", _SUPERVISOR, str(pids)], env={**os.environ,
                                  "TMPDIR": str(temporary)})
    try:
        assert wait_for(lambda: len(list(pids.glob("*.pid"))) == 2, timeout_s=30)
        workers = [int(path.read_text()) for path in pids.glob("*.pid")]
        assert all(_running(pid) for pid in workers)
    finally:
        supervisor.kill()
        supervisor.wait()
    try:
        assert wait_for(lambda: not any(_running(pid) for pid in workers), timeout_s=5), "orphaned workers still run"
    finally:
        for pid in filter(_running, workers):  # what a failure left running: not left to outlive the test
            os.kill(pid, signal.SIGKILL)
    left = sorted(path.name.split("-")[1] for path in temporary.iterdir())
    assert left == ["metrics", "workers"]  # a killed supervisor cannot remove its own
    live = temporary / f"kinference-workers-{os.getpid()}-live"  # a running supervisor's: kept
    live.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    Supervisor(1, lambda report: [sys.executable, "-c", "pass"], grace_s=1).run()
    assert list(temporary.iterdir()) == [live]


# A device process that makes no progress on its first start and serves on its second: "hung" reports it (a device
# batch past its limit), "silent" writes one report and no more (stopped, or stuck holding the GIL).
_STALLING = """
import os, pathlib, sys, time
import orjson
report, mode, flag = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3])
first = not flag.exists()
flag.touch()
hung = "a device batch of model 'm' has run 9.0 s, past --device-hang-s (1 s)" if first and mode == "hung" else None
body = {"pid": os.getpid(), "health": {"progress": hung is None}, "ready": {"model_loaded": True},
        "problems": [hung] if hung else [], "progress": {"limit_s": 1.0, "stalled_s": 9.0 if hung else 0.0,
                                                         "hung": hung}}
while True:
    open(report + ".tmp", "wb").write(orjson.dumps(body)); os.replace(report + ".tmp", report)
    time.sleep(3600 if first and mode == "silent" else 0.1)
"""


@pytest.mark.parametrize(("kind", "mode"), [("device", "hung"), ("device", "silent"), ("worker", "silent")])
def test_a_member_that_makes_no_progress_is_killed_and_replaced_and_named_until_then(tmp_path: Path, kind: str,
                                                                                     mode: str):
    """Issue 36, item 2: one progress rule for every child. A device process that reports a hung batch, or whose
    report goes silent, and a worker whose report goes silent (stopped, or a thread holding the GIL) is killed and
    started again, and health names it until the new one is ready."""
    def command(member: Member) -> list[str]:
        return [sys.executable, "-c", _STALLING, str(member.report), mode, str(tmp_path / "started-once")]

    supervisor = Supervisor(int(kind == "worker"), command, grace_s=5, devices=int(kind == "device"),
                            metrics_dir=tmp_path / "metrics", restarts=Restarts(backoff_s=(0.3, 0.3)))
    member, name = (supervisor.devices if kind == "device" else supervisor.workers)[0], f"{kind} 0"
    runner = threading.Thread(target=supervisor.run)
    runner.start()
    seen: list[dict[str, str]] = []
    try:
        def replaced_and_serving() -> bool:
            seen.append(supervisor.problems())
            return member.restarts == 1 and supervisor.health_checks() == {name: True}

        assert wait_for(replaced_and_serving, timeout_s=15)
        assert member.last_exit == -signal.SIGKILL
        named = [problems[name] for problems in seen if name in problems]
        assert any(why.startswith("replaced: ") for why in named), named
        assert any(("past --device-hang-s (1 s)" if mode == "hung" else "no report for") in why for why in named)
        assert not supervisor.problems()
    finally:
        supervisor.stop()
        runner.join(15)


def test_a_worker_s_report_limit_is_the_device_hang_limit_with_a_floor():
    from kinference.consumer.ops.supervisor import WORKER_HANG_FLOOR_S, worker_hang_limit

    assert worker_hang_limit("auto") == {"limit_s": 60.0, "hung": None}  # no calibration of its own: an engine's
    assert worker_hang_limit(3.0)["limit_s"] == WORKER_HANG_FLOOR_S  # a short test limit does not kill slow reports
    assert worker_hang_limit(120.0)["limit_s"] == 120.0
