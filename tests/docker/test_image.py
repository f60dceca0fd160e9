"""deploy/Dockerfile's image, built here (a local Debian base, wheels from a wheelhouse) and run against a test's own
Apache Kafka over host networking: it answers requests, as its non-root user, and Docker reports it healthy."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from kinference.consumer.brokers.apache_kafka import ApacheKafkaBroker
from kinference.consumer.brokers.broker import free_port
from kinference.consumer.ops.topics import create_topics
from tests.docker.conftest import wait_healthy

# The images are built in the first test's fixtures when they are not there yet (minutes: images.py).
pytestmark = [pytest.mark.docker, pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(2400)]

REQUESTS = 100


def loadgen(bootstrap: str, requests: str, replies: str, out: Path) -> dict:
    """``kinference loadgen`` from this venv: REQUESTS requests, 4 in flight; its JSON report."""
    command = [sys.executable, "-m", "kinference", "loadgen", "--bootstrap-servers", bootstrap,
               "--request-topic", requests, "--reply-topic", replies, "--requests", str(REQUESTS),
               "--concurrency", "4", "--warmup", "0", "--timeout", "30", "--no-progress", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


def test_the_image_serves_a_test_kafka_as_its_non_root_user_and_reports_healthy(kinference_image, kafka_jars,
                                                                                containers, tmp_path):
    run_id = uuid.uuid4().hex[:8]
    topics = {role: f"docker-{role}-{run_id}" for role in ("requests", "replies", "dead")}
    metrics_port = free_port()
    with ApacheKafkaBroker() as kafka:
        create_topics(kafka.bootstrap_servers, {topics["requests"]: 2, topics["replies"]: 2, topics["dead"]: 1})
        name = f"kinference-image-{run_id}"
        containers.append(name)
        environment = {
            "KINFERENCE_BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
            "KINFERENCE_REQUEST_TOPICS": topics["requests"],
            "KINFERENCE_REPLY_TOPIC": topics["replies"],
            "KINFERENCE_DEAD_LETTER_TOPIC": topics["dead"],
            "KINFERENCE_GROUP_ID": f"docker-{run_id}",
            "KINFERENCE_METRICS_PORT": str(metrics_port),
            "KINFERENCE_TORCH_THREADS": "1",
        }
        flags = [arg for key, value in environment.items() for arg in ("--env", f"{key}={value}")]
        subprocess.run(["docker", "run", "--detach", "--name", name, "--network", "host", *flags, kinference_image,
                        "--handler", "echo"], capture_output=True, text=True, timeout=120, check=True)
        # The image's own HEALTHCHECK (kinference healthcheck, every 15 s) finds the port in the environment.
        state = wait_healthy(name, timeout_s=240)
        status = Path(f"/proc/{state['Pid']}/status").read_text()
        uid = next(line.split()[1] for line in status.splitlines() if line.startswith("Uid:"))
        assert uid == "10001", f"kinference runs as uid {uid}, not the image's user 10001"
        report = loadgen(kafka.bootstrap_servers, topics["requests"], topics["replies"], tmp_path / "report.json")
    assert (report["sent"], report["ok"], report["lost"], report["errors"]) == (REQUESTS, REQUESTS, 0, {})
