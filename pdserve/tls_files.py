"""A TLS endpoint's PEM files, read again when they change: every TLS server of pdserve (the
gRPC API, the HTTP API, the metrics port, the KV endpoint) serves a certificate renewed in place,
as cert-manager and the kubelet renew it, without a restart.

The files are checked at each new connection's handshake (a `stat` of each); connections
already open keep the certificate they started with. Files unreadable mid-rotation keep the
ones loaded before.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from pathlib import Path

import grpc

log = logging.getLogger(__name__)


class CertificateFiles:
    """A certificate chain, its key and an optional CA (of the peers' certificates), and what
    they last looked like on disk. `what` names the endpoint in log lines."""

    def __init__(
        self,
        cert_file: str | Path,
        key_file: str | Path,
        ca_file: str | Path | None = None,
        what: str = "TLS endpoint",
    ) -> None:
        self.cert, self.key = Path(cert_file), Path(key_file)
        self.ca = Path(ca_file) if ca_file else None
        self.what = what
        self._stamp: tuple | None = None
        self._lock = threading.Lock()  # a threaded server may handshake on several threads

    def _current_stamp(self) -> tuple:
        files = [p for p in (self.cert, self.key, self.ca) if p]
        return tuple((s.st_mtime_ns, s.st_size, s.st_ino) for s in map(os.stat, files))

    def grpc_configuration(self) -> grpc.ServerCertificateConfiguration:
        stamp = self._current_stamp()
        ca = self.ca.read_bytes() if self.ca else None
        pair = (self.key.read_bytes(), self.cert.read_bytes())
        configuration = grpc.ssl_server_certificate_configuration([pair], root_certificates=ca)
        self._stamp = stamp
        return configuration

    def grpc_configuration_if_changed(self) -> grpc.ServerCertificateConfiguration | None:
        """Called by gRPC before each handshake: None keeps the configuration it has."""
        return self._if_changed(self.grpc_configuration)

    def load_into(self, context: ssl.SSLContext) -> None:
        """The files into `context` (its later handshakes serve them)."""
        stamp = self._current_stamp()
        context.load_cert_chain(self.cert, self.key)
        if self.ca:
            context.load_verify_locations(self.ca)
        self._stamp = stamp  # after a failed load (mid-rotation), the next handshake tries again

    def reload_at_handshakes(self, context: ssl.SSLContext) -> None:
        """Each handshake of `context` first loads the files again if they changed: the
        certificate of the connection being accepted is the new one already."""
        self.load_into(context)

        def before_handshake(connection: ssl.SSLObject, _server_name, _context) -> None:
            # Called whether or not the client names a server (it does not when it dials an IP).
            if self._if_changed(lambda: self.load_into(context)):
                # The connection was made from the context before the load, and OpenSSL ignores
                # setting a connection's context to the one it has: it takes a fresh copy.
                connection.context = self._fresh_context(context.verify_mode)

        context.sni_callback = before_handshake

    def _fresh_context(self, verify_mode: ssl.VerifyMode) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.verify_mode = verify_mode
        context.load_cert_chain(self.cert, self.key)
        if self.ca:
            context.load_verify_locations(self.ca)
        return context

    def _if_changed(self, load):
        with self._lock:
            try:
                if self._current_stamp() == self._stamp:
                    return None
                loaded = load() or True
            except (OSError, ValueError, ssl.SSLError) as error:
                log.warning(
                    "TLS files of the %s unreadable, keeping the loaded ones: %s", self.what, error
                )
                return None
        log.info("TLS files of the %s changed: serving the new certificate", self.what)
        return loaded


def reloading_server_credentials(
    files: CertificateFiles, require_client_auth: bool
) -> grpc.ServerCredentials:
    """gRPC server credentials of `files` that follow them as they change."""
    return grpc.dynamic_ssl_server_credentials(
        files.grpc_configuration(),
        files.grpc_configuration_if_changed,
        require_client_authentication=require_client_auth,
    )
