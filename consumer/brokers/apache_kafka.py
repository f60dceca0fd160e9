"""Apache Kafka as a local broker for tests and benchmarks: the real broker users run, from Maven Central.

One combined broker + controller in KRaft mode, on free loopback ports, with its data in a temporary
directory. Its jars are resolved once with Maven from ``apache_kafka.pom.xml`` (beside this file) and cached
under ``~/.cache/kinference/apache-kafka/<pom hash>/``. It needs a JDK 17+ and Maven (``apt install
openjdk-17-jre-headless maven``), and no Docker. ``KINFERENCE_KAFKA_LIBS=DIR`` points at jars already on disk.

``with ApacheKafkaBroker() as broker: broker.bootstrap_servers``. The embedded Tansu broker
(``kinference.consumer.brokers.broker.EmbeddedBroker``) stays the default for the demo and ``serve --embedded-broker``:
it is pip-only, with no JVM.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import logging
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

from confluent_kafka.admin import AdminClient

from kinference.consumer.brokers.ports import free_port
from kinference.errors import BrokerError

log = logging.getLogger(__name__)

POM = Path(__file__).with_name("apache_kafka.pom.xml")
_JARS_READY = ".complete"
_LOG4J2 = """\
status = warn
appender.console.type = Console
appender.console.name = console
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = {level}
rootLogger.appenderRef.console.ref = console
"""

# Settings of a single-node cluster that starts in seconds and lets tests run at test speed. Each departs from
# a production default only where one node or a short test needs it.
BROKER_DEFAULTS: Mapping[str, str] = {
    # One node: every internal topic has one replica.
    "offsets.topic.replication.factor": "1",
    "transaction.state.log.replication.factor": "1",
    "transaction.state.log.min.isr": "1",
    "share.coordinator.state.topic.replication.factor": "1",
    "share.coordinator.state.topic.min.isr": "1",
    # Fewer partitions of the internal topics: each is created on first use, 50 of them take seconds.
    "offsets.topic.num.partitions": "4",
    "transaction.state.log.num.partitions": "4",
    "share.coordinator.state.topic.num.partitions": "4",
    # A classic group's first join is not held back 3 s waiting for more members.
    "group.initial.rebalance.delay.ms": "0",
    # The log cleaner looks for work every 0.2 s (15 s by default): a test of a compacted topic sees it compacted.
    "log.cleaner.backoff.ms": "200",
    # kinference never relies on topic auto-creation: a test that did would fail here, as on most clusters.
    "auto.create.topics.enable": "false",
    # Fault tests use sessions down to 2 s to see a dead member sooner (the broker's floor is 6 s).
    "group.min.session.timeout.ms": "1000",
    # KIP-848 (consumer) and KIP-932 (share) groups keep their session on the broker (45 s by default): tests
    # that kill a member use the 6 s the classic protocol's tests ask for.
    "group.consumer.min.session.timeout.ms": "6000",
    "group.consumer.session.timeout.ms": "6000",
    "group.consumer.min.heartbeat.interval.ms": "1000",
    "group.consumer.heartbeat.interval.ms": "2000",
    "group.share.min.session.timeout.ms": "6000",
    "group.share.session.timeout.ms": "6000",
    "group.share.min.heartbeat.interval.ms": "1000",
    "group.share.heartbeat.interval.ms": "2000",
}


def kafka_version(pom: Path = POM) -> str:
    """The Apache Kafka release the pom pins."""
    match = re.search(r"<kafka.version>([^<]+)</kafka.version>", pom.read_text())
    return match.group(1) if match else "unknown"


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kinference" / "apache-kafka"


def broker_jars(pom: Path = POM, cache: Path | None = None) -> Path:
    """The directory of the broker's jars: ``KINFERENCE_KAFKA_LIBS``, else resolved with Maven from ``pom`` into
    a cache keyed by the pom's content. Processes that ask at once (pytest-xdist workers) resolve it once."""
    if libs := os.environ.get("KINFERENCE_KAFKA_LIBS"):
        if not any(Path(libs).glob("kafka_2.13-*.jar")):
            raise BrokerError(f"KINFERENCE_KAFKA_LIBS={libs} holds no kafka_2.13 jar")
        return Path(libs)
    for tool in ("java", "mvn"):
        if shutil.which(tool) is None:
            raise BrokerError(f"Apache Kafka needs a JDK 17+ and Maven ('{tool}' is not on PATH): "
                              "apt install openjdk-17-jre-headless maven")
    root = cache or cache_root()
    jars = root / hashlib.sha256(pom.read_bytes()).hexdigest()[:16]
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (jars / _JARS_READY).exists():
            _resolve(pom, jars)
    return jars


def _resolve(pom: Path, jars: Path) -> None:
    log.info("resolving Apache Kafka's jars with Maven from %s into %s", pom, jars)
    shutil.rmtree(jars, ignore_errors=True)
    command = ["mvn", "-q", "-B", "-f", str(pom), "dependency:copy-dependencies", "-DincludeScope=runtime",
               f"-DoutputDirectory={jars}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
    if result.returncode != 0:
        raise BrokerError(f"Maven could not resolve Apache Kafka's jars (exit {result.returncode}): "
                          f"{(result.stdout + result.stderr)[-2000:]}")
    (jars / _JARS_READY).touch()


def _cluster_id() -> str:
    """A KRaft cluster id: a random UUID as Kafka prints one (URL-safe base64, no padding), never one that starts
    with ``-``: the storage tool's argument parser takes that for an option (1 id in 64; Kafka's own
    ``Uuid.randomUuid`` draws again for it too)."""
    while (cluster_id := base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()).startswith("-"):
        pass
    return cluster_id


class ApacheKafkaBroker:
    """An Apache Kafka process that this object started and alone stops (by PID: SIGTERM, then SIGKILL).

    ``properties`` are added to (and override) ``BROKER_DEFAULTS`` in the generated ``server.properties``;
    ``features`` are the KRaft feature levels the storage is formatted with (``share.version=1`` enables
    KIP-932 share groups). ``heap`` is the JVM's fixed heap: small, as tests and benches on 2 cores need.

    A subclass may secure it: ``listeners`` (name: security protocol; the first is ``bootstrap_servers``, and the
    one brokers use among themselves), each on a free port of ``ports``; ``client_properties``, what a client of
    the first listener needs (this object's own readiness check uses them); ``storage_arguments``, more arguments
    of the storage tool's ``format`` (``--add-scram``: SCRAM credentials that exist before the broker starts).
    """

    listeners: Mapping[str, str] = {"PLAINTEXT": "PLAINTEXT"}
    client_properties: Mapping[str, str] = {}
    storage_arguments: tuple[str, ...] = ()

    kind = "kafka"
    description = f"Apache Kafka {kafka_version()}"
    # librdkafka's own fetch settings are right here: Apache Kafka answers a waiting fetch as data arrives.
    consumer_properties: Mapping[str, str] = {}
    host = "127.0.0.1"
    """Loopback only: a broker for tests and benchmarks, never reachable from another machine."""

    def __init__(
        self,
        port: int | None = None,
        properties: Mapping[str, str] | None = None,
        features: Mapping[str, int] | None = None,
        heap: str = "512m",
        start_timeout_s: float = 90.0,
        log_file: Path | None = None,
    ) -> None:
        self.port = port or free_port(self.host)
        self.ports = {name: self.port if i == 0 else free_port(self.host) for i, name in enumerate(self.listeners)}
        self.properties = {**BROKER_DEFAULTS, **(properties or {})}
        self.features = {"share.version": 1, **(features or {})}
        self.heap = heap
        self.start_timeout_s = start_timeout_s
        self.log_file = log_file
        self._process: subprocess.Popen[bytes] | None = None
        self._directory: Path | None = None
        self._log_path: Path | None = None

    @property
    def bootstrap_servers(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start(self) -> ApacheKafkaBroker:
        if self._process is not None:
            raise BrokerError("Apache Kafka already started")
        jars = broker_jars()
        self._directory = Path(tempfile.mkdtemp(prefix="kinference-kafka-"))
        try:
            config = self._write_config(self._directory)
            self._format(jars, config)
            self._launch(jars, config)
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        log.info("Apache Kafka ready on %s (pid %d)", self.bootstrap_servers, self.pid)
        return self

    def _write_config(self, directory: Path) -> Path:
        controller = free_port(self.host)
        advertised = ",".join(f"{name}://{self.host}:{port}" for name, port in self.ports.items())
        protocols = ",".join(f"{name}:{protocol}" for name, protocol in self.listeners.items())
        settings = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.voters": f"1@{self.host}:{controller}",
            "listeners": f"{advertised},CONTROLLER://{self.host}:{controller}",
            "advertised.listeners": advertised,
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": f"CONTROLLER:PLAINTEXT,{protocols}",
            "inter.broker.listener.name": next(iter(self.listeners)),
            "log.dirs": str(directory / "data"),
            **self.properties,
        }
        config = directory / "server.properties"
        config.write_text("".join(f"{key}={value}\n" for key, value in settings.items()))
        level = os.environ.get("KINFERENCE_KAFKA_LOG_LEVEL", "WARN")
        (directory / "log4j2.properties").write_text(_LOG4J2.format(level=level))
        return config

    def _java(self, jars: Path, *arguments: str) -> list[str]:
        assert self._directory is not None
        java = str(Path(os.environ["JAVA_HOME"]) / "bin" / "java") if os.environ.get("JAVA_HOME") else "java"
        return [java, f"-Xms{self.heap}", f"-Xmx{self.heap}", "-XX:+UseSerialGC", "-Djava.awt.headless=true",
                f"-Dlog4j2.configurationFile={self._directory / 'log4j2.properties'}",
                "-cp", f"{jars}/*", *arguments]

    def _format(self, jars: Path, config: Path) -> None:
        features = [arg for name, level in self.features.items() for arg in ("--feature", f"{name}={level}")]
        command = self._java(jars, "kafka.tools.StorageTool", "format", "--cluster-id", _cluster_id(),
                             "--config", str(config), "--ignore-formatted", *features,
                             *self.storage_arguments)
        result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        if result.returncode != 0:
            raise BrokerError(f"formatting Apache Kafka's storage failed (exit {result.returncode}): "
                              f"{(result.stdout + result.stderr)[-2000:]}")

    def _launch(self, jars: Path, config: Path) -> None:
        assert self._directory is not None
        log_path = self.log_file or self._directory / "broker.log"
        with open(log_path, "ab") as output:
            self._process = subprocess.Popen(self._java(jars, "kafka.Kafka", str(config)), stdout=output,
                                             stderr=subprocess.STDOUT, start_new_session=True)
        self._log_path = log_path

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        admin = AdminClient({"bootstrap.servers": self.bootstrap_servers, "log_level": 0, **self.client_properties})
        while time.monotonic() < deadline:
            assert self._process is not None
            if self._process.poll() is not None:
                raise BrokerError(f"Apache Kafka exited at start with code {self._process.returncode}: "
                                  f"{self.log_tail()}")
            try:
                if admin.list_topics(timeout=1.0).brokers:
                    return
            except Exception:  # KafkaException until the listener answers
                pass
            time.sleep(0.2)
        raise BrokerError(f"Apache Kafka did not answer on {self.bootstrap_servers} within "
                          f"{self.start_timeout_s:.0f} s: {self.log_tail()}")

    def log_tail(self, characters: int = 3000) -> str:
        path = self._log_path
        if path is None or not path.exists():
            return "(no log)"
        return path.read_text(errors="replace")[-characters:]

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM (a controlled shutdown), then SIGKILL if it hangs; the data directory goes with it."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout_s)
        directory, self._directory = self._directory, None
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)

    def __enter__(self) -> ApacheKafkaBroker:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
