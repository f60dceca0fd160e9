"""The stand-in Kafka image's entrypoint: apache/kafka's configuration by environment, then the broker as PID 1.

``KAFKA_FOO_BAR=x`` becomes ``foo.bar=x`` in server.properties (``__`` stands for ``_``, ``___`` for ``-``), as
apache/kafka's start scripts do; the JVM's own variables are not broker settings. ``CLUSTER_ID`` formats the
storage on the first start (``--ignore-formatted`` after that).
"""

import os
import subprocess
import sys
from pathlib import Path

CONFIG = Path("/opt/kafka/config")
CLASSPATH = "/opt/kafka/libs/*"
NOT_BROKER_SETTINGS = {"KAFKA_HEAP_OPTS", "KAFKA_OPTS", "KAFKA_LOG4J_OPTS", "KAFKA_JVM_PERFORMANCE_OPTS",
                       "KAFKA_LOG4J_ROOT_LOGLEVEL", "KAFKA_VERSION"}
LOG4J2 = """\
appender.console.type = Console
appender.console.name = console
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = {level}
rootLogger.appenderRef.console.ref = console
"""


def broker_settings(environment: dict[str, str]) -> dict[str, str]:
    settings = {}
    for name, value in environment.items():
        if name.startswith("KAFKA_") and name not in NOT_BROKER_SETTINGS:
            key = name[len("KAFKA_"):].lower().replace("___", "-").replace("__", "\0").replace("_", ".")
            settings[key.replace("\0", "_")] = value
    return settings


def java(*arguments: str) -> list[str]:
    heap = os.environ.get("KAFKA_HEAP_OPTS", "-Xms512m -Xmx512m").split()
    return ["java", *heap, "-XX:+UseSerialGC", "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={CONFIG / 'log4j2.properties'}", "-cp", CLASSPATH, *arguments]


def main() -> None:
    properties = CONFIG / "server.properties"
    properties.write_text("".join(f"{key}={value}\n" for key, value in broker_settings(dict(os.environ)).items()))
    level = os.environ.get("KAFKA_LOG4J_ROOT_LOGLEVEL", "WARN")
    (CONFIG / "log4j2.properties").write_text(LOG4J2.format(level=level))
    cluster_id = os.environ.get("CLUSTER_ID")
    if not cluster_id:
        sys.exit("CLUSTER_ID is not set: any base64 UUID (kafka-storage.sh random-uuid)")
    subprocess.run(java("kafka.tools.StorageTool", "format", "--cluster-id", cluster_id, "--config", str(properties),
                        "--ignore-formatted"), check=True)
    command = java("kafka.Kafka", str(properties))
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
