"""The Apache Kafka test broker's pure parts (the broker itself runs in make test-kafka)."""

from __future__ import annotations

import base64
import uuid

from kinference.consumer.brokers import apache_kafka


def test_a_cluster_id_never_starts_with_a_dash(monkeypatch):
    """kafka-storage's argument parser takes an id starting with '-' for an option: about one format in 64 failed
    with 'argument --cluster-id/-t: expected one argument' (a CI run lost a worker's whole broker to it)."""
    dash_first = uuid.UUID(bytes=base64.urlsafe_b64decode("-" + "A" * 21 + "=="))
    drawn = iter([dash_first, uuid.UUID(int=1)])
    monkeypatch.setattr(apache_kafka.uuid, "uuid4", lambda: next(drawn))
    assert apache_kafka._cluster_id() == base64.urlsafe_b64encode(uuid.UUID(int=1).bytes).rstrip(b"=").decode()
    monkeypatch.undo()
    assert all(len(cluster_id) == 22 and not cluster_id.startswith("-")
               for cluster_id in (apache_kafka._cluster_id() for _ in range(2000)))
