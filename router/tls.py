"""TLS for the client API: server credentials from PEM files (a cert-manager Secret mounts
`tls.crt`, `tls.key` and `ca.crt`), with client certificates required when a client CA is set.

The files are read again when they change (pdserve/tls_files.py), so a certificate renewed in
place is served without a restart; connections already open keep the one they started with.
"""

from __future__ import annotations

from pathlib import Path

import grpc

from pdserve.tls_files import CertificateFiles, reloading_server_credentials


def server_credentials(
    cert_file: str | Path, key_file: str | Path, client_ca_file: str | Path | None = None
) -> grpc.ServerCredentials:
    """TLS with this certificate chain and key; with `client_ca_file`, mutual TLS: a client
    must present a certificate that CA signed."""
    files = CertificateFiles(cert_file, key_file, client_ca_file, what="client API")
    return reloading_server_credentials(files, require_client_auth=client_ca_file is not None)
