"""Apache Kafka secured three ways at once, with KRaft's ACL authorizer, for tests/integration/test_security.py.

One broker, three client listeners, each reachable only with its credentials:

- ``SCRAM``: SASL_SSL with SCRAM-SHA-512 (users made by the admin API; the admin's own at format time);
- ``MTLS``: SSL with client certificates required, signed by the test's CA (principal ``User:CN=<name>``);
- ``OAUTHBEARER``: SASL_SSL with OAUTHBEARER, validated by Kafka's unsecured validator (its default without a
  JWKS endpoint), which takes librdkafka's unsecured test token (``sasl.oauthbearer.config=principal=<name>``).

``org.apache.kafka.metadata.authorizer.StandardAuthorizer`` denies every principal what no ACL allows, except the
super users: ``User:admin``, who provisions users and ACLs and whose SCRAM login the broker also uses to reach
itself (transaction markers go to a partition's leader over the inter-broker listener, here the broker itself),
and ``User:ANONYMOUS``, the broker on the plaintext controller listener (loopback; clients never bootstrap there).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from confluent_kafka.admin import (
    AclBinding,
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ResourcePatternType,
    ResourceType,
    ScramCredentialInfo,
    ScramMechanism,
    UserScramCredentialUpsertion,
)

from kinference.consumer.brokers.apache_kafka import ApacheKafkaBroker
from tests.certificates import CertificateAuthority

ADMIN = "admin"
ADMIN_PASSWORD = "admin-S3cret"
MECHANISMS = ("SCRAM", "MTLS", "OAUTHBEARER")


@dataclass(frozen=True)
class Login:
    """How one principal reaches the broker: its listener's address and its librdkafka properties."""

    principal: str
    bootstrap_servers: str
    properties: dict[str, str]


class SecuredKafka(ApacheKafkaBroker):
    listeners = {"SCRAM": "SASL_SSL", "MTLS": "SSL", "OAUTHBEARER": "SASL_SSL"}
    storage_arguments = ("--add-scram", f"SCRAM-SHA-512=[name={ADMIN},password={ADMIN_PASSWORD}]")

    def __init__(self, authority: CertificateAuthority) -> None:
        self.authority = authority
        server = authority.server()
        self.client_properties = {**_scram(ADMIN, ADMIN_PASSWORD), "ssl.ca.location": str(authority.ca)}
        super().__init__(properties={
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "super.users": f"User:{ADMIN};User:ANONYMOUS",
            "ssl.keystore.type": "PEM",
            "ssl.keystore.certificate.chain": _inline(server.cert.read_text()),
            "ssl.keystore.key": _inline(server.key.read_text()),
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": str(authority.ca),
            "listener.name.scram.sasl.enabled.mechanisms": "SCRAM-SHA-512",
            "listener.name.scram.scram-sha-512.sasl.jaas.config": "org.apache.kafka.common.security.scram."
            f'ScramLoginModule required username="{ADMIN}" password="{ADMIN_PASSWORD}";',
            "sasl.mechanism.inter.broker.protocol": "SCRAM-SHA-512",
            "listener.name.mtls.ssl.client.auth": "required",
            "listener.name.oauthbearer.sasl.enabled.mechanisms": "OAUTHBEARER",
            "listener.name.oauthbearer.oauthbearer.sasl.jaas.config":
                "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule required;",
        })
        self._admin: AdminClient | None = None

    def stop(self, timeout_s: float = 20.0) -> None:
        self._admin = None  # before the broker goes: it would only retry, and say so
        super().stop(timeout_s)

    def address(self, listener: str) -> str:
        return f"{self.host}:{self.ports[listener]}"

    @property
    def admin(self) -> AdminClient:
        if self._admin is None:
            self._admin = AdminClient({"bootstrap.servers": self.bootstrap_servers, **self.client_properties})
        return self._admin

    def login(self, mechanism: str, name: str) -> Login:
        """A new principal ``name`` that logs in with ``mechanism`` (a SCRAM user is created for it)."""
        ca = {"ssl.ca.location": str(self.authority.ca)}
        if mechanism == "SCRAM":
            password = f"{name}-S3cret"
            upsert = UserScramCredentialUpsertion(name, ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 4096),
                                                  password.encode())
            for future in self.admin.alter_user_scram_credentials([upsert]).values():
                future.result(30)
            return Login(f"User:{name}", self.address("SCRAM"), {**_scram(name, password), **ca})
        if mechanism == "MTLS":
            issued = self.authority.client(name)
            return Login(f"User:CN={name}", self.address("MTLS"),
                         {"security.protocol": "SSL", **ca, "ssl.certificate.location": str(issued.cert),
                          "ssl.key.location": str(issued.key)})
        if mechanism == "OAUTHBEARER":
            return Login(f"User:{name}", self.address("OAUTHBEARER"),
                         {"security.protocol": "SASL_SSL", "sasl.mechanism": "OAUTHBEARER", **ca,
                          "enable.sasl.oauthbearer.unsecure.jwt": "true",
                          "sasl.oauthbearer.config": f"principal={name}"})
        raise ValueError(f"no mechanism {mechanism!r}: one of {MECHANISMS}")

    def grant(self, bindings: Iterable[AclBinding], timeout_s: float = 30.0) -> None:
        """Create ACLs and return once the broker's authorizer holds them (they reach it through the metadata log)."""
        bindings = list(bindings)
        for future in self.admin.create_acls(bindings, request_timeout=timeout_s).values():
            future.result(timeout_s)
        principals = {binding.principal for binding in bindings}
        deadline = time.monotonic() + timeout_s
        for principal in principals:
            wanted = {acl_key(binding) for binding in bindings if binding.principal == principal}
            while not wanted <= {acl_key(binding) for binding in self.acls(principal)}:
                assert time.monotonic() < deadline, f"the broker's authorizer did not get {principal}'s ACLs"
                time.sleep(0.1)

    def acls(self, principal: str) -> list[AclBinding]:
        """Every ACL of ``principal``, as the broker's authorizer has it."""
        match = AclBindingFilter(ResourceType.ANY, None, ResourcePatternType.ANY, principal, None, AclOperation.ANY,
                                 AclPermissionType.ANY)
        return self.admin.describe_acls(match, request_timeout=30).result(30)


def allow(principal: str, resource: ResourceType, name: str, operation: AclOperation,
          pattern: ResourcePatternType = ResourcePatternType.LITERAL) -> AclBinding:
    return AclBinding(resource, name, pattern, principal, "*", operation, AclPermissionType.ALLOW)


def acl_key(binding: AclBinding) -> tuple:
    return (binding.restype, binding.name, binding.resource_pattern_type, binding.principal, binding.operation)


def _scram(user: str, password: str) -> dict[str, str]:
    return {"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": user,
            "sasl.password": password}


def _inline(pem: str) -> str:
    """A PEM file as one line of server.properties: Java's Properties reads ``\\n`` back as a line break."""
    return pem.strip().replace("\n", "\\n")
