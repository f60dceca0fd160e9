"""A throwaway certificate authority for the secured-Kafka tests: a CA, a broker certificate for 127.0.0.1 and
localhost, and client certificates, all signed by the CA and written as PEM files (keys unencrypted, PKCS#8)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Issued:
    """A certificate and its key, as PEM files."""

    cert: Path
    key: Path


class CertificateAuthority:
    """Issues certificates valid for a day into ``directory``; ``ca`` is its own certificate."""

    def __init__(self, directory: Path, name: str = "kinference test CA") -> None:
        self.directory = directory
        self.name = name
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._cert = self._sign(name, self._key, (x509.BasicConstraints(ca=True, path_length=None), True))
        self.ca = self._write(name.replace(" ", "-"), self._cert, self._key).cert

    def server(self) -> Issued:
        """A broker certificate for 127.0.0.1 and localhost."""
        key = ec.generate_private_key(ec.SECP256R1())
        alternative_names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        cert = self._sign("localhost", key, (x509.SubjectAlternativeName(alternative_names), False),
                          (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False))
        return self._write("server", cert, key)

    def client(self, common_name: str) -> Issued:
        """A client certificate whose subject is ``CN=common_name``: Kafka's principal ``User:CN=common_name``."""
        key = ec.generate_private_key(ec.SECP256R1())
        cert = self._sign(common_name, key, (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), False))
        return self._write(common_name, cert, key)

    def _sign(self, subject: str, key, *extensions) -> x509.Certificate:
        now = datetime.datetime.now(datetime.UTC)
        builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(self.name))
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1)))
        for extension, critical in extensions:
            builder = builder.add_extension(extension, critical=critical)
        return builder.sign(self._key, hashes.SHA256())

    def _write(self, stem: str, cert: x509.Certificate, key) -> Issued:
        issued = Issued(self.directory / f"{stem}.crt", self.directory / f"{stem}.key")
        issued.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        issued.key.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                 serialization.NoEncryption()))
        return issued


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])
