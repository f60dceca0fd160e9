"""Secured Kafka, the way a new user meets it: KINFERENCE_KAFKA (a Secret in k8s) configures `kinference topics
create`, `kinference serve`, `kinference loadgen` and `Client.from_env` alike, over SASL_SSL (TLS and a SASL/PLAIN
login) and over mutual TLS, with certificates signed by a CA that the test generates.

Neither the embedded broker (Tansu 0.6.0) nor librdkafka's mock cluster can authenticate a client or talk TLS
(tests/secure_front.py says exactly why), so a front door of the test's own terminates TLS and speaks the broker's
side of SASL/PLAIN before Tansu, which advertises the front's address: every connection of every client goes
through it. The clients are unchanged librdkafka clients, so these tests show that kinference passes the
properties to each client it makes (consumer, producer, lag and topic admin clients) and that those complete real
TLS and SASL handshakes. Not tested here, because no broker available to the tests implements them: SCRAM and
OAUTHBEARER logins, ACLs (docs/security.md lists what each delivery mode needs), certificate revocation.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from confluent_kafka.admin import AdminClient

from kinference import Client
from kinference.consumer.broker import broker_binary, free_port
from tests.conftest import TEST_CONSUMER_PROPERTIES
from tests.integration.test_cli import ServeProcess, kinference
from tests.processes import stop, until_answering
from tests.secure_front import Certificates, SecureFront, make_certificates

pytestmark = pytest.mark.integration

PASSWORD = "kinference-S3cret"
HANDLERS_DOC = Path(__file__).resolve().parents[2] / "docs" / "handlers.md"


@pytest.fixture(scope="module")
def certificates(tmp_path_factory) -> Certificates:
    pytest.importorskip("cryptography", reason="the test generates its CA with the cryptography package")
    return make_certificates(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def tansu_behind() -> Iterator[tuple[int, int]]:
    """(the broker's own port, the port it advertises: where the test's front door will listen)."""
    own, advertised = free_port(), free_port()
    process = subprocess.Popen([broker_binary(), "broker", "--listener-url", f"tcp://127.0.0.1:{own}",
                                "--advertised-listener-url", f"tcp://127.0.0.1:{advertised}"],
                               env={**os.environ, "RUST_LOG": "warn"}, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        admin = AdminClient({"bootstrap.servers": f"127.0.0.1:{own}", "log_level": 0})
        until_answering(process, lambda: admin.list_topics(timeout=1))
        yield own, advertised
    finally:
        stop(process)


def refuses(bootstrap: str, **properties: str) -> bool:
    """Whether a client with ``properties`` gets no metadata through the front door."""
    try:
        AdminClient({"bootstrap.servers": bootstrap, "log_level": 0, **properties}).list_topics(timeout=4)
    except Exception:
        return True
    return False


def own_handler(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """docs/handlers.md's example handler on PYTHONPATH, and a small model directory for it."""
    import re

    from tests.models import build_tiny_classifier

    source = next(block for block in re.findall(r"```python\n(.*?)```", HANDLERS_DOC.read_text(), re.S)
                  if "class Sentiment" in block)
    package = tmp_path / "handlers" / "my_handlers"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sentiment.py").write_text(source)
    model = build_tiny_classifier(tmp_path / "models" / "sentiment")
    return {"PYTHONPATH": os.pathsep.join([str(package.parent), *sys.path])}, model


def run_secured(bootstrap: str, kafka: dict[str, str], unique_id: str, tmp_path: Path, own_model: bool) -> None:
    """The new user's steps against a secured broker: topics, serve, a client request, a loadgen run."""
    env = {"KINFERENCE_BOOTSTRAP_SERVERS": bootstrap, "KINFERENCE_KAFKA": orjson.dumps(kafka).decode()}
    topics = {"requests": f"in-{unique_id}", "replies": f"out-{unique_id}", "dead": f"dead-{unique_id}"}
    names = ["--request-topics", topics["requests"], "--reply-topic", topics["replies"], "--dead-letter-topic",
             topics["dead"]]
    made = kinference("topics", "create", *names, "--partitions", "2", env=env)
    assert made.returncode == 0 and made.stdout.count("created") == 3, made.stdout + made.stderr

    serve_env = dict(env)
    handler = ["--handler", "echo"]
    if own_model:
        path, model = own_handler(tmp_path)
        serve_env |= path
        handler = ["--handler", "my_handlers.sentiment:Sentiment", "--model", str(model)]
    consumer = [arg for key, value in TEST_CONSUMER_PROPERTIES.items()
                for arg in ("--kafka-consumer", f"{key}={value}")]
    serve = ServeProcess([*names, *handler, *consumer, "--group-id", f"secure-{unique_id}", "--no-metrics",
                          "--lag-interval-s", "1"], serve_env)
    try:
        assert serve.assigned.wait(90), serve.log
        client = Client.from_env(topics["requests"], topics["replies"], environ=env, timeout_s=30,
                                 reply_consumer={"fetch.wait.max.ms": "10"})
        with client:
            result = client.request({"text": "the cat sat on the mat"}).result()
        assert ("label" in result and 0 < result["score"] <= 1) if own_model else \
            result == {"text": "the cat sat on the mat"}
        out = tmp_path / "loadgen.json"
        load = kinference("loadgen", "--request-topic", topics["requests"], "--reply-topic", topics["replies"],
                          "--requests", "20", "--concurrency", "2", "--warmup", "0", "--timeout", "20",
                          "--no-progress", "--out", str(out), "--kafka", "fetch.wait.max.ms=10", env=env)
        assert load.returncode == 0, load.stdout[-2000:] + load.stderr[-2000:]
        report = orjson.loads(out.read_bytes())
        assert report["ok"] == report["sent"] == 20, report
        assert serve.terminate_and_wait() == 0, serve.log
    finally:
        serve.kill()


def test_sasl_ssl_topics_serve_client_and_loadgen_with_your_own_model(tansu_behind, certificates, unique_id,
                                                                         tmp_path):
    own, front_port = tansu_behind
    bootstrap = f"127.0.0.1:{front_port}"
    kafka = {"security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN", "sasl.username": "kinference",
             "sasl.password": PASSWORD, "ssl.ca.location": str(certificates.ca)}
    with SecureFront(front_port, ("127.0.0.1", own), certificates, users={"kinference": PASSWORD}) as front:
        assert refuses(bootstrap), "a plaintext client got through"
        assert refuses(bootstrap, **{**kafka, "sasl.password": "wrong"}), "a wrong password got through"
        (tmp_path / "other").mkdir()
        other_ca = make_certificates(tmp_path / "other").ca
        assert refuses(bootstrap, **{**kafka, "ssl.ca.location": str(other_ca)}), \
            "a broker certificate from another CA was trusted"
        assert any("SASL login of 'kinference'" in why for why in front.refused)
        logins = len(front.logins)
        run_secured(bootstrap, kafka, unique_id, tmp_path, own_model=True)
        # Every client logged in: topics' admin, serve's consumer, producer and lag admin, the client, loadgen.
        assert len(front.logins) - logins >= 6 and set(front.logins) == {"kinference"}


def test_mutual_tls_topics_serve_client_and_loadgen(tansu_behind, certificates, unique_id, tmp_path):
    own, front_port = tansu_behind
    bootstrap = f"127.0.0.1:{front_port}"
    kafka = {"security.protocol": "SSL", "ssl.ca.location": str(certificates.ca),
             "ssl.certificate.location": str(certificates.client_cert),
             "ssl.key.location": str(certificates.client_key)}
    with SecureFront(front_port, ("127.0.0.1", own), certificates, mutual_tls=True) as front:
        assert refuses(bootstrap), "a plaintext client got through"
        assert refuses(bootstrap, **{"security.protocol": "SSL", "ssl.ca.location": str(certificates.ca)}), \
            "a client without a certificate got through"
        assert any(why.startswith("TLS") for why in front.refused)
        run_secured(bootstrap, kafka, unique_id, tmp_path, own_model=False)
