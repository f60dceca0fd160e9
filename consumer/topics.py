"""Topic creation: ``kinference topics create`` and the embedded broker's set-up.

The service never relies on topic auto-creation (brokers that allow it create topics with their own
defaults, and a typo in a reply-to header would create a topic): topics are made up front, here.
"""

from __future__ import annotations

import logging
import time

from confluent_kafka.admin import AdminClient, NewTopic

from kinference.errors import BrokerError

log = logging.getLogger(__name__)

BROKER_DEFAULT = -1
"""``replication_factor`` that lets the broker choose (``default.replication.factor``; Kafka >= 2.4)."""


def create_topics(
    bootstrap_servers: str,
    topics: dict[str, int],
    timeout_s: float = 30.0,
    replication_factor: int = 1,
    **config: str,
) -> list[str]:
    """Create ``{name: partitions}`` topics; topics that already exist are left as they are.

    ``config`` holds librdkafka properties of the admin client (security, SASL). Returns the names of
    the topics that were created.
    """
    admin = AdminClient({"bootstrap.servers": bootstrap_servers, **config})
    futures = admin.create_topics(
        [NewTopic(name, num_partitions=parts, replication_factor=replication_factor)
         for name, parts in topics.items()],
        operation_timeout=timeout_s,
        request_timeout=timeout_s,
    )
    created = []
    for name, future in futures.items():
        try:
            future.result(timeout_s)
            created.append(name)
        except Exception as exc:
            if "TOPIC_ALREADY_EXISTS" not in str(exc):
                raise BrokerError(f"cannot create topic {name!r}: {exc}") from exc
    _wait_for_leaders(admin, created, time.monotonic() + timeout_s)
    return created


def _wait_for_leaders(admin: AdminClient, topics: list[str], deadline: float) -> None:
    """Return once every partition of ``topics`` has a leader. Apache Kafka acknowledges a creation before the
    brokers have elected leaders: a client that asks at once (the request-reply client's end offsets) gets
    NOT_LEADER_FOR_PARTITION."""
    waiting = set(topics)
    while waiting:
        metadata = admin.list_topics(timeout=max(0.1, deadline - time.monotonic()))
        waiting = {name for name in waiting if name not in metadata.topics or metadata.topics[name].error is not None
                   or any(p.leader < 0 for p in metadata.topics[name].partitions.values())}
        if waiting and time.monotonic() > deadline:
            raise BrokerError(f"topics {sorted(waiting)} have no leader yet")
        if waiting:
            time.sleep(0.05)
