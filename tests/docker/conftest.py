"""Fixtures of the docker tests: a Docker engine, the images (tests/docker/images.py), an Apache Kafka of the test's.

Every docker test is marked ``docker`` (``-m "not docker"`` leaves them out) and skips, saying why, where no Docker
engine answers. Containers use host networking only: the test machines have no bridge network, and every port
is a free port of 127.0.0.1.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator

import pytest

from kinference.errors import BrokerError
from tests.docker import images


def _built(build: Callable[[], str]) -> str:
    problem = images.docker_problem()
    if problem:
        pytest.skip(f"needs a Docker engine: {problem}")
    try:
        return build()
    except images.DockerUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def kinference_image() -> str:
    return _built(images.kinference_image)


@pytest.fixture(scope="session")
def kafka_image() -> str:
    return _built(images.kafka_image)


@pytest.fixture(scope="session")
def prometheus_image() -> str:
    return _built(images.prometheus_image)


@pytest.fixture(scope="session")
def kafka_jars() -> None:
    """Apache Kafka's jars (Maven Central): the test broker and the Kafka stand-in both run them."""
    from kinference.consumer.brokers.apache_kafka import broker_jars

    try:
        broker_jars()
    except BrokerError as exc:
        pytest.skip(str(exc))


@pytest.fixture
def containers() -> Iterator[list[str]]:
    """Names of the containers a test starts: removed after it, with their logs printed on failure."""
    names: list[str] = []
    yield names
    for name in names:
        logs = subprocess.run(["docker", "logs", "--tail", "60", name], capture_output=True, text=True, timeout=60)
        print(f"--- docker logs {name} ---\n{logs.stdout}{logs.stderr}")
        subprocess.run(["docker", "rm", "--force", "--volumes", name], capture_output=True, timeout=120)


def inspect(name: str) -> dict:
    done = subprocess.run(["docker", "inspect", name], capture_output=True, text=True, timeout=60, check=True)
    (details,) = json.loads(done.stdout)
    return details


def wait_healthy(name: str, timeout_s: float) -> dict:
    """The container's details once Docker's health check says healthy; fails at once if it stops."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = inspect(name)["State"]
        health = state.get("Health", {}).get("Status")
        if health == "healthy":
            return state
        assert state["Running"], f"{name} stopped (exit {state['ExitCode']}) before it was healthy"
        assert time.monotonic() < deadline, f"{name} not healthy within {timeout_s:.0f} s: {state.get('Health')}"
        time.sleep(1)
