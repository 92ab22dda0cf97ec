"""TLS for the client API: server credentials from PEM files (a cert-manager Secret mounts
`tls.crt`, `tls.key` and `ca.crt`), with client certificates required when a client CA is set.

The files are read again when they change (checked at each new connection's handshake), so a
certificate renewed in place, as cert-manager and the kubelet do it, is served without a
restart; connections already open keep the certificate they started with.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import grpc

log = logging.getLogger(__name__)


class _CertificateFiles:
    """The PEM files and what they last looked like on disk."""

    def __init__(self, cert_file: Path, key_file: Path, client_ca_file: Path | None) -> None:
        self._cert, self._key, self._client_ca = cert_file, key_file, client_ca_file
        self._stamp: tuple | None = None

    def _current_stamp(self) -> tuple:
        files = [p for p in (self._cert, self._key, self._client_ca) if p]
        return tuple((s.st_mtime_ns, s.st_size, s.st_ino) for s in map(os.stat, files))

    def load(self) -> grpc.ServerCertificateConfiguration:
        self._stamp = self._current_stamp()
        client_ca = self._client_ca.read_bytes() if self._client_ca else None
        pair = (self._key.read_bytes(), self._cert.read_bytes())
        return grpc.ssl_server_certificate_configuration([pair], root_certificates=client_ca)

    def reload_if_changed(self) -> grpc.ServerCertificateConfiguration | None:
        """Called by gRPC before each handshake: None keeps the configuration it has."""
        try:
            if self._current_stamp() == self._stamp:
                return None
            config = self.load()
        except (OSError, ValueError) as error:  # mid-rotation or broken: keep the old one
            log.warning(
                "TLS files of the client API unreadable, keeping the loaded ones: %s", error
            )
            return None
        log.info("TLS files of the client API changed: serving the new certificate")
        return config


def server_credentials(
    cert_file: str | Path, key_file: str | Path, client_ca_file: str | Path | None = None
) -> grpc.ServerCredentials:
    """TLS with this certificate chain and key; with `client_ca_file`, mutual TLS: a client
    must present a certificate that CA signed."""
    files = _CertificateFiles(
        Path(cert_file), Path(key_file), Path(client_ca_file) if client_ca_file else None
    )
    return grpc.dynamic_ssl_server_credentials(
        files.load(),
        files.reload_if_changed,
        require_client_authentication=client_ca_file is not None,
    )
