"""A throwaway CA and certificates it signs, written as PEM files (for TLS tests)."""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass
class Issued:
    cert: Path
    key: Path


class TestCA:
    """`ca.pem` plus `issue(name, server=...)` of leaf certificates, all under `directory`."""

    __test__ = False  # not a pytest class

    def __init__(self, directory: Path, name: str = "pdserve test CA") -> None:
        self.directory = directory
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        cert = (
            _builder(self._name, self._key.public_key())
            .issuer_name(self._name)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self.cert = directory / f"{name.replace(' ', '-')}.pem"
        self.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, name: str, *, server: bool) -> Issued:
        """A leaf certificate: for 127.0.0.1 and localhost if `server`, else a client's."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (
            _builder(subject, key.public_key())
            .issuer_name(self._name)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if server:
            names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        issued = Issued(self.directory / f"{name}.crt", self.directory / f"{name}.key")
        issued.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        issued.key.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return issued


def _builder(subject: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
    )


def install(issued: Issued, cert: Path, key: Path) -> None:
    """Puts `issued` at `cert` and `key` as the kubelet swaps a Secret volume's files."""
    for source, target in ((issued.cert, cert), (issued.key, key)):
        staged = target.with_suffix(".new")
        staged.write_bytes(source.read_bytes())
        os.replace(staged, target)


def served_certificate(port: int, client: Issued | None = None) -> x509.Certificate:
    """The certificate a TLS server on 127.0.0.1:`port` presents to a new connection (HTTP/2
    offered, for gRPC servers; a client certificate, for servers that require one)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    context.set_alpn_protocols(["h2", "http/1.1"])
    if client:
        context.load_cert_chain(client.cert, client.key)
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw) as connection,
    ):
        return x509.load_der_x509_certificate(connection.getpeercert(binary_form=True))


def certificate_of(issued: Issued) -> x509.Certificate:
    return x509.load_pem_x509_certificate(issued.cert.read_bytes())
