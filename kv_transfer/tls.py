"""TLS of the KV endpoint (both transports' control plane, and the grpc transport's payloads).

With `tls_cert`, `tls_key` and `tls_ca` set (PEM files; a cert-manager Secret mounts them as
`tls.crt`, `tls.key`, `ca.crt`), a decode worker's KV endpoint serves TLS with its certificate,
and a prefill worker dials it verifying the certificate against `tls_ca` and presenting its own
(the same files: one certificate per worker, for both serverAuth and clientAuth). With
`tls_client_auth` (the default) the endpoint refuses a peer without a certificate `tls_ca` signed:
mutual TLS, the one setting under which received KV counts as coming from an authenticated peer.
Peers dial an IP address, so a certificate must name it, or every worker's certificate names
`tls_server_name` and senders expect that name instead.
"""

from __future__ import annotations

from pathlib import Path

import grpc

from pdserve.config import KVTransferConfig
from pdserve.tls_files import CertificateFiles, reloading_server_credentials


def tls_enabled(config: KVTransferConfig) -> bool:
    return bool(config.tls_cert)


def _pem(config: KVTransferConfig, name: str) -> bytes:
    path = getattr(config, name)
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"KVTransferConfig.{name}: cannot read {path!r}: {exc}") from exc


def server_credentials(config: KVTransferConfig) -> grpc.ServerCredentials | None:
    """The KV endpoint's credentials; None when TLS is off. Files renewed in place are served
    from the next handshake on (pdserve/tls_files.py)."""
    if not tls_enabled(config):
        return None
    for name in ("tls_key", "tls_cert", "tls_ca"):
        _pem(config, name)  # unreadable: a clear error now
    files = CertificateFiles(config.tls_cert, config.tls_key, config.tls_ca, what="KV endpoint")
    return reloading_server_credentials(files, require_client_auth=config.tls_client_auth)


def channel_credentials(config: KVTransferConfig) -> grpc.ChannelCredentials | None:
    """A sender's credentials: trusts `tls_ca`, presents this worker's certificate."""
    if not tls_enabled(config):
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_pem(config, "tls_ca"),
        private_key=_pem(config, "tls_key"),
        certificate_chain=_pem(config, "tls_cert"),
    )


def channel_options(config: KVTransferConfig) -> list[tuple[str, str]]:
    """Expect `tls_server_name` in the receiver's certificate instead of the dialed host."""
    if tls_enabled(config) and config.tls_server_name:
        return [("grpc.ssl_target_name_override", config.tls_server_name)]
    return []
