"""Topic creation: ``kinference topics create`` and the embedded broker's set-up.

The service never relies on topic auto-creation (brokers that allow it create topics with their own
defaults, and a typo in a reply-to header would create a topic): topics are made up front, here. Topics that
exist already are never changed; ``differences`` says where they differ from what was asked.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic

from kinference.errors import BrokerError

log = logging.getLogger(__name__)

KAFKA_MESSAGE_MAX_BYTES = 1_048_588
"""Apache Kafka's default ``message.max.bytes``: a topic's ``max.message.bytes`` when nothing sets it."""


def create_topics(
    bootstrap_servers: str,
    topics: dict[str, int],
    timeout_s: float = 30.0,
    replication_factor: int = 1,
    topic_config: Mapping[str, str] | None = None,
    admin_config: Mapping[str, str] | None = None,
) -> list[str]:
    """Create ``{name: partitions}`` topics with ``topic_config`` (``retention.ms``...); topics that already
    exist are left as they are.

    ``admin_config`` holds librdkafka properties of the admin client (security, SASL). Returns the names of
    the topics that were created.
    """
    admin = AdminClient({"bootstrap.servers": bootstrap_servers, **(admin_config or {})})
    futures = admin.create_topics(
        [NewTopic(name, num_partitions=parts, replication_factor=replication_factor, config=dict(topic_config or {}))
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


def differences(
    bootstrap_servers: str,
    topics: dict[str, int],
    topic_config: Mapping[str, str] | None = None,
    timeout_s: float = 30.0,
    admin_config: Mapping[str, str] | None = None,
) -> dict[str, list[str]]:
    """How each existing topic of ``topics`` differs from what was asked: its partition count, and each asked
    topic config the broker reports another value for (a config it does not report is not compared)."""
    admin = AdminClient({"bootstrap.servers": bootstrap_servers, **(admin_config or {})})
    try:
        metadata = admin.list_topics(timeout=timeout_s).topics
    except Exception as exc:
        raise BrokerError(f"cannot list topics: {exc}") from exc
    found: dict[str, list[str]] = {}
    for name, partitions in topics.items():
        if name not in metadata:
            continue
        notes = found.setdefault(name, [])
        have = len(metadata[name].partitions)
        if have != partitions:
            notes.append(f"{have} partitions, not {partitions}")
    if topic_config and found:
        resources = [ConfigResource(ConfigResource.Type.TOPIC, name) for name in found]
        for resource, future in admin.describe_configs(resources, request_timeout=timeout_s).items():
            try:
                entries = future.result(timeout_s)
            except Exception as exc:
                found[resource.name].append(f"its configs could not be read ({exc})")
                continue
            for key, asked in topic_config.items():
                entry = entries.get(key)
                if entry is not None and entry.value is not None and entry.value != asked:
                    found[resource.name].append(f"{key}={entry.value}, not {asked}")
    return {name: notes for name, notes in found.items() if notes}
