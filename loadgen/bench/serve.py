"""What a contender serves (``contender`` runs it in a process of its own): kinference, or a baseline loop.

Both are context managers that run until exit; ``functools.partial`` them with what they serve, so that they
pickle into the contender's process. Every kinference contender gets the baselines' consumer settings
(``SERVE_KAFKA``), so that the differences measured are batching and threading, not librdkafka tuning.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from kinference.consumer.config import ServiceConfig
from kinference.consumer.service import Service, settle_heap
from kinference.loadgen.bench.baselines import TRANSPORT_CONSUMER, LoopThread
from kinference.loadgen.bench.contender import READY_TIMEOUT_S, Topics, ready_or_fail

SERVE_KAFKA = {key: TRANSPORT_CONSUMER[key] for key in ("session.timeout.ms", "heartbeat.interval.ms",
                                                          "fetch.wait.max.ms")}


@contextmanager
def serve_kinference(overrides: dict[str, Any], handler: str, bootstrap_servers: str, topics: Topics,
                     tracer_provider: Any = None) -> Iterator[Service]:
    """A kinference contender (``functools.partial`` it with ``overrides`` and ``handler`` for ``contender``);
    ``tracer_provider`` is ``Service``'s, for a contender with ``tracing`` on."""
    config = ServiceConfig(
        bootstrap_servers=bootstrap_servers, request_topics=[topics["requests"]],
        reply_topic=topics["replies"], dead_letter_topic=topics["dead"],
        group_id=f"bench-{topics['requests']}", handler=handler, kafka_consumer=SERVE_KAFKA,
        metrics=False, shutdown_grace_s=5.0, **overrides)
    with Service(config, tracer_provider=tracer_provider) as service:
        settle_heap()  # as ``kinference serve`` does
        ready_or_fail(service.wait_ready(READY_TIMEOUT_S), config.group_id)
        yield service


@contextmanager
def serve_loop(make: Callable[[str, str], LoopThread], bootstrap_servers: str, topics: Topics
               ) -> Iterator[LoopThread]:
    """A baseline loop built by ``make(bootstrap_servers, request_topic)`` (a picklable callable)."""
    with make(bootstrap_servers, topics["requests"]) as loop:
        ready_or_fail(loop.wait_ready(READY_TIMEOUT_S), loop.group_id)
        yield loop
