"""A secured listener in front of the embedded broker, for the secured-Kafka tests.

Tansu 0.6.0 (the embedded broker) cannot show a client authenticating or talking TLS: its ``--authentication``
accepts SCRAM handshakes but stores no credentials (``tansu user create`` succeeds and every login then fails
with unknown-user), has no OAUTHBEARER validator, and its ``--cert``/``--key`` flags exclude each other, so it
never listens with TLS. librdkafka's mock cluster (``test.mock.num.brokers``) listens in plaintext only.

So the tests put this front door before Tansu, which advertises the front's address: it terminates TLS with a
certificate signed by a CA the test generates (and, for mTLS, requires a client certificate signed by it), and
it speaks the broker's side of SASL/PLAIN (``SaslHandshake``, ``SaslAuthenticate``), refusing every other request
until the client has logged in with a known user and password. Everything after that is forwarded to Tansu
byte for byte. The clients under test are unchanged librdkafka clients configured by ``KINFERENCE_KAFKA``:
what is tested is that kinference hands those properties to every client it makes, and that those clients
complete real TLS and SASL handshakes. What a real broker adds (ACLs, SCRAM, OAUTHBEARER token validation) is not
tested here.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import socket
import ssl
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

_API_VERSIONS, _SASL_HANDSHAKE, _SASL_AUTHENTICATE = 18, 17, 36
_UNSUPPORTED_SASL_MECHANISM, _SASL_AUTHENTICATION_FAILED = 33, 58


@dataclass(frozen=True)
class Certificates:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_certificates(directory: Path) -> Certificates:
    """A CA, a server certificate for 127.0.0.1 and localhost, and a client certificate, all signed by the CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def issue(subject: str, key, issuer_key, *extensions) -> x509.Certificate:
        builder = (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(name("kinference test CA"))
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1)))
        for extension, critical in extensions:
            builder = builder.add_extension(extension, critical=critical)
        return builder.sign(issuer_key, hashes.SHA256())

    def write(path: Path, cert: x509.Certificate, key) -> None:
        path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        path.with_suffix(".key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                               serialization.PrivateFormat.PKCS8,
                                                               serialization.NoEncryption()))

    ca_key, server_key, client_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    ca = issue("kinference test CA", ca_key, ca_key, (x509.BasicConstraints(ca=True, path_length=None), True))
    server = issue("localhost", server_key, ca_key,
                   (x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                 x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False),
                   (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False))
    client = issue("kinference", client_key, ca_key,
                   (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), False))
    write(directory / "ca", ca, ca_key)
    write(directory / "server", server, server_key)
    write(directory / "client", client, client_key)
    return Certificates(directory / "ca.crt", directory / "server.crt", directory / "server.key",
                        directory / "client.crt", directory / "client.key")


class SecureFront:
    """Listens on 127.0.0.1:``port``; TLS with ``certificates`` (client certificates required with
    ``mutual_tls``), SASL/PLAIN with ``users`` ({name: password}) when given; forwards to ``upstream``."""

    def __init__(self, port: int, upstream: tuple[str, int], certificates: Certificates | None = None,
                 mutual_tls: bool = False, users: dict[str, str] | None = None) -> None:
        self.upstream = upstream
        self.users = users
        self.logins: list[str] = []
        """Every user that logged in, in order (a failed login is not listed)."""
        self.refused: list[str] = []
        """Why connections were refused: a failed TLS handshake or login, a request before login."""
        self._context = None
        if certificates is not None:
            self._context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self._context.load_cert_chain(certificates.server_cert, certificates.server_key)
            if mutual_tls:
                self._context.verify_mode = ssl.CERT_REQUIRED
                self._context.load_verify_locations(certificates.ca)
        self._server = socket.create_server(("127.0.0.1", port))
        self._stop = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        self._server.close()

    def __enter__(self) -> SecureFront:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            if self._context is not None:
                client.settimeout(10)
                client = self._context.wrap_socket(client, server_side=True)
                client.settimeout(None)
            upstream = socket.create_connection(self.upstream)
        except (OSError, ssl.SSLError) as exc:
            self._note_refused(f"TLS: {exc}")
            client.close()
            return
        try:
            if self.users is not None and not self._login(client, upstream):
                raise ConnectionError("not logged in")
        except (OSError, ConnectionError):
            client.close()
            upstream.close()
            return
        threading.Thread(target=_pump, args=(upstream, client), daemon=True).start()
        _pump(client, upstream)

    def _login(self, client: socket.socket, upstream: socket.socket) -> bool:
        """The broker's side of SASL/PLAIN; ApiVersions goes to the broker, anything else first is refused."""
        while True:
            frame = _read_frame(client)
            api_key, api_version, correlation = struct.unpack(">hhi", frame[:8])
            if api_key == _API_VERSIONS:
                upstream.sendall(struct.pack(">i", len(frame)) + frame)
                client.sendall(_with_size(_read_frame(upstream)))
            elif api_key == _SASL_HANDSHAKE:
                mechanism = _string_after_client_id(frame)
                error = 0 if mechanism == "PLAIN" else _UNSUPPORTED_SASL_MECHANISM
                client.sendall(_with_size(struct.pack(">ihi", correlation, error, 1) + _string(b"PLAIN")))
                if error:
                    self._note_refused(f"SASL mechanism {mechanism}")
                    return False
            elif api_key == _SASL_AUTHENTICATE and api_version <= 1:
                auth = _bytes_after_client_id(frame)
                _, user, password = [*auth.split(b"\0"), b"", b""][:3]
                ok = self.users.get(user.decode(errors="replace")) == password.decode(errors="replace")
                message = b"" if ok else b"invalid user or password"
                body = struct.pack(">ih", correlation, 0 if ok else _SASL_AUTHENTICATION_FAILED)
                body += _string(message) if message else struct.pack(">h", -1)
                body += struct.pack(">i", 0)
                if api_version >= 1:
                    body += struct.pack(">q", 0)
                client.sendall(_with_size(body))
                if ok:
                    with self._lock:
                        self.logins.append(user.decode())
                    return True
                self._note_refused(f"SASL login of {user.decode(errors='replace')!r}")
                return False
            else:
                self._note_refused(f"request {api_key} before the SASL login")
                return False

    def _note_refused(self, why: str) -> None:
        with self._lock:
            self.refused.append(why)


def _pump(source: socket.socket, target: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            target.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (source, target):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def _read_frame(sock: socket.socket) -> bytes:
    (size,) = struct.unpack(">i", _read_exactly(sock, 4))
    return _read_exactly(sock, size)


def _with_size(body: bytes) -> bytes:
    return struct.pack(">i", len(body)) + body


def _string(value: bytes) -> bytes:
    return struct.pack(">h", len(value)) + value


def _after_client_id(frame: bytes) -> int:
    """Offset of a non-flexible request's body: after api key, version, correlation id and client id."""
    (length,) = struct.unpack(">h", frame[8:10])
    return 10 + max(length, 0)


def _string_after_client_id(frame: bytes) -> str:
    start = _after_client_id(frame)
    (length,) = struct.unpack(">h", frame[start:start + 2])
    return frame[start + 2:start + 2 + length].decode()


def _bytes_after_client_id(frame: bytes) -> bytes:
    start = _after_client_id(frame)
    (length,) = struct.unpack(">i", frame[start:start + 4])
    return frame[start + 4:start + 4 + length]
