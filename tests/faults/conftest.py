"""Fixtures of the process-level fault tests (``-m faults``): a fresh group and topics per test."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest

from tests.faults.harness import Settings


@pytest.fixture
def fault_settings(broker) -> Callable[..., Settings]:
    """``fault_settings(partitions=3, **flags)``: new request (``partitions``), reply (1) and
    dead-letter (1) topics and a new group id, as the ``kinference serve`` flags of a test's members."""

    def make(partitions: int = 3, **overrides: Any) -> Settings:
        topics = broker.topics(requests=partitions, replies=1, dead=1)
        return Settings(broker.bootstrap_servers, topics, f"faults-{uuid.uuid4().hex[:10]}", partitions,
                        broker_kind=broker.kind, **overrides)

    return make
