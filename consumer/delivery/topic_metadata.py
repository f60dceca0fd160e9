"""Which topics exist, so that a request naming an allowed reply topic that does not is answered at once.

A reply produced to a missing topic waits in librdkafka until its delivery times out (~30 s in the tests,
minutes by default), holding a place in the in-flight window: 2,500 such requests once took a neighbour's p50
from 17 ms to 11.6 s. And producing to it asks the broker for the topic's metadata, which creates the topic on a
broker that auto-creates (Apache Kafka's default; Tansu creates on any metadata request naming a topic).

So the decoder asks ``ExistingTopics`` first. It lists the cluster's topics with a metadata request that names
none (which creates none), and keeps the list: a topic in it is served, a topic not in it is looked up again
only when the list is older than ``miss_refresh_s`` (a burst of requests to one missing topic costs one metadata
request, not one each), and the whole list is read again once it is older than ``max_age_s``. The poll thread
runs these lookups: each is bounded by ``timeout_s``, and when the broker does not answer the list read last
stays in use.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

log = logging.getLogger(__name__)


def list_topics(client: Any, timeout_s: float) -> set[str]:
    """The names of the cluster's topics, from one metadata request for all of them: ``client`` is any
    confluent-kafka client (an ``AdminClient`` here)."""
    metadata = client.list_topics(timeout=timeout_s)
    return {name for name, topic in metadata.topics.items() if topic.error is None}


class ExistingTopics:
    """The topics of the cluster, as of the last metadata request (see the module's docstring)."""

    def __init__(self, lister: Callable[[float], set[str]], miss_refresh_s: float = 1.0, max_age_s: float = 30.0,
                 timeout_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        """``lister(timeout_s)``: the names of the cluster's topics; it may raise ``KafkaException``."""
        self._lister = lister
        self._miss_refresh_s = miss_refresh_s
        self._max_age_s = max_age_s
        self._timeout_s = timeout_s
        self._clock = clock
        self._known: set[str] = set()
        self._read_at = -float("inf")

    @classmethod
    def of(cls, client_config: dict[str, str]) -> ExistingTopics:
        """Topics as an admin client of ``client_config`` (bootstrap servers, security) lists them. The client
        connects at its first lookup, not here."""
        client: AdminClient | None = None

        def lister(timeout_s: float) -> set[str]:
            nonlocal client
            client = client or AdminClient({**client_config})
            return list_topics(client, timeout_s)

        return cls(lister)

    def __call__(self, topic: str) -> bool:
        """Whether ``topic`` exists, as far as the cluster's metadata says."""
        age = self._clock() - self._read_at
        if age >= self._max_age_s or (topic not in self._known and age >= self._miss_refresh_s):
            self._read()
        return topic in self._known

    def _read(self) -> None:
        self._read_at = self._clock()
        try:
            self._known = self._lister(self._timeout_s)
        except KafkaException as exc:
            log.warning("could not list the cluster's topics (%s); reply topics are checked against the list read "
                        "before", exc)
