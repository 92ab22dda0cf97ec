"""TLS for the client API: server credentials from PEM files (a cert-manager Secret mounts
`tls.crt`, `tls.key` and `ca.crt`), with client certificates required when a client CA is set."""

from __future__ import annotations

from pathlib import Path

import grpc


def server_credentials(
    cert_file: str | Path, key_file: str | Path, client_ca_file: str | Path | None = None
) -> grpc.ServerCredentials:
    """TLS with this certificate chain and key; with `client_ca_file`, mutual TLS: a client
    must present a certificate that CA signed."""
    pair = (Path(key_file).read_bytes(), Path(cert_file).read_bytes())
    client_ca = Path(client_ca_file).read_bytes() if client_ca_file else None
    return grpc.ssl_server_credentials(
        [pair], root_certificates=client_ca, require_client_auth=client_ca is not None
    )
