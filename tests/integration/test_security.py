"""Secured Kafka on Apache Kafka itself (tests/secured_kafka.py): one broker, reachable over SASL_SSL with
SCRAM-SHA-512, over mutual TLS and over SASL_SSL with OAUTHBEARER, that authorizes with KRaft's StandardAuthorizer.

- Each listener refuses a client without its credentials.
- A new user's steps, configured by ``KINFERENCE_KAFKA`` alone (a Secret in k8s): ``kinference topics create``,
  ``kinference serve`` with their own handler and model, ``Client.from_env`` and ``kinference loadgen``.
- The matrix, mechanism x delivery mode: in each cell a principal of its own serves with exactly the ACLs that
  docs/security.md's table lists for its mode (read from there), a client principal with the table's client column
  sends requests, and neither sees any topic but its own.
- A share group member without AlterConfigs on its group stops at start and says which ACL it lacks.

It starts its own Apache Kafka whatever the suite's broker (``KINFERENCE_TEST_BROKER``), and skips without a JDK and
Maven."""

from __future__ import annotations

import itertools
import logging
import os
import re
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AclBinding, AclOperation, AdminClient, ResourcePatternType, ResourceType

from kinference import Client, protocol
from kinference.consumer.ops.topics import create_topics
from kinference.consumer.service import Service
from kinference.errors import BrokerError
from tests.conftest import TEST_CONSUMER_PROPERTIES
from tests.integration.kafka_io import headers_of, read, service_config
from tests.integration.test_cli import ServeProcess, kinference

pytest.importorskip("cryptography", reason="the test generates its CA with the cryptography package")

from tests.certificates import CertificateAuthority
from tests.secured_kafka import MECHANISMS, Login, SecuredKafka, acl_key, allow

pytestmark = [pytest.mark.integration, pytest.mark.slow]
log = logging.getLogger(__name__)

DOCS = Path(__file__).resolve().parents[2] / "docs"
SESSION = {key: value for key, value in TEST_CONSUMER_PROPERTIES.items() if "session" in key or "heartbeat" in key}
MODES = {
    "at-least-once": {},
    "exactly-once": {"delivery": "exactly-once"},
    "share group": {"group_type": "share", "kafka_consumer": {}},  # a share consumer refuses the session settings
}


@pytest.fixture(scope="module")
def secured(tmp_path_factory) -> Iterator[SecuredKafka]:
    from kinference.consumer.brokers.apache_kafka import broker_jars

    try:
        broker_jars()
    except BrokerError as exc:
        pytest.skip(f"secured Kafka runs on Apache Kafka: {exc}")
    with SecuredKafka(CertificateAuthority(tmp_path_factory.mktemp("tls"))) as kafka:
        # Someone else's topic, that no test's principal may see.
        create_topics(kafka.bootstrap_servers, {"someone-elses": 1}, admin_config=kafka.client_properties)
        yield kafka


@dataclass(frozen=True)
class Names:
    """A test's own topics, group and principals' names."""

    suffix: str
    requests: str
    replies: str
    dead: str
    group: str

    @classmethod
    def unique(cls) -> Names:
        suffix = uuid.uuid4().hex[:10]
        return cls(suffix, f"in-{suffix}", f"out-{suffix}", f"dead-{suffix}", f"group-{suffix}")

    @property
    def topics(self) -> dict[str, str]:
        return {"requests": self.requests, "replies": self.replies, "dead": self.dead}


def documented_acls(column: str) -> list[tuple[str, list[str]]]:
    """The rows of docs/security.md's ACL table that ``column`` marks (its cell starts with "yes"): (resource,
    operations)."""
    lines = (DOCS / "security.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| resource | operations |"))
    header = _cells(lines[start])
    rows = [_cells(line) for line in itertools.takewhile(lambda line: line.startswith("|"), lines[start + 2:])]
    at = header.index(column)
    return [(row[0], [op.strip() for op in row[1].split(",")]) for row in rows if row[at].startswith("yes")]


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def bindings(column: str, principal: str, names: Names) -> list[AclBinding]:
    """The ACLs that docs/security.md's ``column`` gives ``principal``, on the test's own names."""
    resources = {
        "Topic: each request topic": [(ResourceType.TOPIC, names.requests, ResourcePatternType.LITERAL)],
        "Topic: the reply topic": [(ResourceType.TOPIC, names.replies, ResourcePatternType.LITERAL)],
        "Topic: the dead-letter topic": [(ResourceType.TOPIC, names.dead, ResourcePatternType.LITERAL)],
        "Topic: each of the three": [(ResourceType.TOPIC, name, ResourcePatternType.LITERAL)
                                     for name in names.topics.values()],
        "Group: `group_id`": [(ResourceType.GROUP, names.group, ResourcePatternType.LITERAL)],
        "TransactionalId: `kinference-<group_id>-`": [(ResourceType.TRANSACTIONAL_ID, f"kinference-{names.group}-",
                                                        ResourcePatternType.PREFIXED)],
    }
    granted = []
    for resource, operations in documented_acls(column):
        where = resource.split(" (")[0]
        assert where in resources, f"docs/security.md names a resource this test does not know: {resource!r}"
        for restype, name, pattern in resources[where]:
            granted += [allow(principal, restype, name, _operation(op), pattern) for op in operations]
    return granted


def _operation(name: str) -> AclOperation:
    """``DescribeConfigs`` -> ``AclOperation.DESCRIBE_CONFIGS``."""
    return AclOperation[re.sub(r"(?<!^)(?=[A-Z])", "_", name).upper()]


def visible_topics(login: Login) -> set[str]:
    """The topics whose metadata ``login`` may read: the broker leaves out the others."""
    admin = AdminClient({"bootstrap.servers": login.bootstrap_servers, **login.properties})
    return set(admin.list_topics(timeout=30).topics)


def refuses(bootstrap: str, **properties: str) -> bool:
    """Whether a client with ``properties`` gets no metadata from ``bootstrap``."""
    try:
        AdminClient({"bootstrap.servers": bootstrap, "log_level": 0, **properties}).list_topics(timeout=3)
    except Exception:
        return True
    return False


def each_listener_refuses_a_client_without_its_credentials(secured: SecuredKafka, tmp_path: Path) -> None:
    scram = secured.login("SCRAM", "refused-scram")
    mtls = secured.login("MTLS", "refused-mtls")
    stranger = CertificateAuthority(tmp_path, "another CA")
    strangers_cert = stranger.client("refused-mtls")
    mtls_without_cert = {"security.protocol": "SSL", "ssl.ca.location": str(secured.authority.ca)}
    assert not refuses(scram.bootstrap_servers, **scram.properties), "the right credentials were refused"
    assert not refuses(mtls.bootstrap_servers, **mtls.properties), "the right certificate was refused"
    assert refuses(scram.bootstrap_servers), "a plaintext client got through"
    assert refuses(scram.bootstrap_servers, **{**scram.properties, "sasl.password": "wrong"}), \
        "a wrong password got through"
    assert refuses(scram.bootstrap_servers, **{**scram.properties, "ssl.ca.location": str(stranger.ca)}), \
        "a broker certificate from another CA was trusted"
    assert refuses(mtls.bootstrap_servers, **mtls_without_cert), "a client without a certificate got through"
    assert refuses(mtls.bootstrap_servers, **{**mtls.properties, "ssl.certificate.location": str(strangers_cert.cert),
                                              "ssl.key.location": str(strangers_cert.key)}), \
        "a client certificate from another CA got through"
    assert refuses(secured.address("OAUTHBEARER"), **scram.properties), \
        "the OAUTHBEARER listener took a SCRAM login"


def own_handler(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """docs/handlers.md's example handler on PYTHONPATH, and a small model directory for it."""
    from tests.models import build_tiny_classifier

    source = next(block for block in re.findall(r"```python\n(.*?)```", (DOCS / "handlers.md").read_text(), re.S)
                  if "class Sentiment" in block)
    package = tmp_path / "handlers" / "my_handlers"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sentiment.py").write_text(source)
    model = build_tiny_classifier(tmp_path / "models" / "sentiment")
    return {"PYTHONPATH": os.pathsep.join([str(package.parent), *sys.path])}, model


def environment(login: Login) -> dict[str, str]:
    """A command's whole Kafka configuration, as the k8s Secret gives it."""
    return {"KINFERENCE_BOOTSTRAP_SERVERS": login.bootstrap_servers,
            "KINFERENCE_KAFKA": orjson.dumps(login.properties).decode()}


def topics_serve_client_and_loadgen_with_your_own_model(secured: SecuredKafka, tmp_path: Path) -> None:
    """A new user's steps, each command configured by ``KINFERENCE_KAFKA`` alone and logged in as its own principal
    with its own column of the ACL table."""
    names = Names.unique()
    provisioner, server, user = (secured.login("SCRAM", f"{role}-{names.suffix}")
                                 for role in ("topics", "serve", "user"))
    secured.grant([*bindings("topics create", provisioner.principal, names),
                   *bindings("serve, at-least-once", server.principal, names),
                   *bindings("loadgen, Client", user.principal, names)])
    topic_names = ["--request-topics", names.requests, "--reply-topic", names.replies, "--dead-letter-topic",
                   names.dead]
    made = kinference("topics", "create", *topic_names, "--partitions", "2", env=environment(provisioner))
    assert made.returncode == 0 and made.stdout.count("created") == 3, made.stdout + made.stderr

    path, model = own_handler(tmp_path)
    consumer = [arg for key, value in SESSION.items() for arg in ("--kafka-consumer", f"{key}={value}")]
    serve = ServeProcess([*topic_names, "--handler", "my_handlers.sentiment:Sentiment", "--model", str(model),
                          *consumer, "--group-id", names.group, "--no-metrics", "--lag-interval-s", "1"],
                         environment(server) | path)
    try:
        assert serve.assigned.wait(90), serve.log
        with Client.from_env(names.requests, names.replies, environ=environment(user), timeout_s=30) as client:
            result = client.request({"text": "the cat sat on the mat"}).result()
        assert "label" in result and 0 < result["score"] <= 1, result
        out = tmp_path / "loadgen.json"
        load = kinference("loadgen", "--request-topic", names.requests, "--reply-topic", names.replies,
                          "--requests", "20", "--concurrency", "2", "--warmup", "0", "--timeout", "20",
                          "--no-progress", "--out", str(out), env=environment(user))
        assert load.returncode == 0, load.stdout[-2000:] + load.stderr[-2000:]
        report = orjson.loads(out.read_bytes())
        assert report["ok"] == report["sent"] == 20, report
        assert serve.terminate_and_wait() == 0, serve.log
    finally:
        serve.kill()


def a_principal_with_the_documented_acls_serves(secured: SecuredKafka, mechanism: str, mode: str) -> None:
    """Requests answered, a bad one dead-lettered, by a principal granted only docs/security.md's column for its
    mode; the client's principal has only the client column. Neither sees any topic but its own."""
    names = Names.unique()
    create_topics(secured.bootstrap_servers, {names.requests: 2, names.replies: 1, names.dead: 1},
                  admin_config=secured.client_properties)
    server, user = secured.login(mechanism, f"serve-{names.suffix}"), secured.login(mechanism, f"user-{names.suffix}")
    secured.grant([*bindings(f"serve, {mode}", server.principal, names),
                   *bindings("loadgen, Client", user.principal, names)])
    config = service_config(server.bootstrap_servers, names.topics, group_id=names.group, kafka=server.properties,
                            **{"kafka_consumer": SESSION, **MODES[mode]})
    with Service(config) as service:
        assert service.wait_ready(60)
        with Client(user.bootstrap_servers, names.requests, names.replies, kafka=user.properties,
                     timeout_s=60) as client:
            futures = [client.send({"i": i}) for i in range(10)]
            assert [future.result().result() for future in futures] == [{"i": i} for i in range(10)]
            producer = Producer({"bootstrap.servers": user.bootstrap_servers, **user.properties})
            producer.produce(names.requests, b"{not json", headers=[(protocol.CORRELATION_ID, b"bad")])
            assert producer.flush(30) == 0
        dead = read(secured.bootstrap_servers, names.dead, 1, timeout_s=60, **secured.client_properties)
        assert [headers_of(m)[protocol.CORRELATION_ID] for m in dead] == [b"bad"]
        assert service.healthy
    assert visible_topics(server) == set(names.topics.values())
    assert visible_topics(user) == {names.requests, names.replies}


def a_share_group_member_without_alter_configs_on_its_group_says_which_acl_it_lacks(secured: SecuredKafka) -> None:
    names = Names.unique()
    create_topics(secured.bootstrap_servers, {names.requests: 1, names.replies: 1, names.dead: 1},
                  admin_config=secured.client_properties)
    server = secured.login("SCRAM", f"serve-{names.suffix}")
    alter_configs = allow(server.principal, ResourceType.GROUP, names.group, AclOperation.ALTER_CONFIGS)
    granted = bindings("serve, share group", server.principal, names)
    assert acl_key(alter_configs) in {acl_key(binding) for binding in granted}
    secured.grant(binding for binding in granted if acl_key(binding) != acl_key(alter_configs))
    config = service_config(server.bootstrap_servers, names.topics, group_id=names.group, kafka=server.properties,
                            **MODES["share group"])
    with pytest.raises(BrokerError, match="needs AlterConfigs on its group"), Service(config):
        pass


@pytest.mark.timeout(900)
def test_secured_kafka(secured, tmp_path, caplog):
    """The whole module in one test, so that pytest-xdist cannot spread it over several processes, each starting a
    broker of its own (``--dist loadgroup`` does not group tests on pytest 9.2: pytest-xdist issue 1386). The
    matrix runs every cell, then says which failed."""
    each_listener_refuses_a_client_without_its_credentials(secured, tmp_path)
    topics_serve_client_and_loadgen_with_your_own_model(secured, tmp_path)
    failed = {}
    for mechanism, mode in itertools.product(MECHANISMS, MODES):
        start = time.monotonic()
        try:
            a_principal_with_the_documented_acls_serves(secured, mechanism, mode)
        except Exception as exc:  # AssertionError included: every cell runs, the failures are reported together
            failed[f"{mechanism} x {mode}"] = exc
        log.info("secured Kafka: %s x %s %s in %.1f s", mechanism, mode,
                 "failed" if f"{mechanism} x {mode}" in failed else "served", time.monotonic() - start)
    assert not failed, "\n".join(f"{cell}: {exc!r}" for cell, exc in failed.items())
    # The client needs no group ACL, and says nothing about the group librdkafka makes it name.
    client_warnings = [r.message for r in caplog.records
                       if r.name == "kinference.loadgen.client" and r.levelno >= logging.WARNING]
    assert not client_warnings
    a_share_group_member_without_alter_configs_on_its_group_says_which_acl_it_lacks(secured)
