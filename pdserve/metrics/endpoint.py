"""`start_metrics_server` / `stop_metrics_server`: a process's `/metrics` over HTTP or TLS."""

from __future__ import annotations

from typing import Any

from prometheus_client import start_http_server

from pdserve.tls_files import CertificateFiles

_servers: dict[int, Any] = {}  # bound port -> its HTTP server, for stop_metrics_server


def start_metrics_server(
    port: int = 0, addr: str = "0.0.0.0", tls: CertificateFiles | None = None
) -> int:
    """Serves `/metrics` of the default registry from a daemon thread; returns the bound
    port (pass 0 for an ephemeral one). With `tls`, over TLS, requiring a client certificate
    of its CA when it has one; files renewed in place are served from the next handshake."""
    if tls is None:
        server, _thread = start_http_server(port, addr=addr)
    else:
        server, _thread = start_http_server(
            port,
            addr=addr,
            certfile=str(tls.cert),
            keyfile=str(tls.key),
            client_cafile=str(tls.ca) if tls.ca else None,
            client_auth_required=tls.ca is not None,
        )
        tls.reload_at_handshakes(server.socket.context)
    _servers[server.server_port] = server
    return server.server_port


def stop_metrics_server(port: int) -> None:
    """Stops the server `start_metrics_server` bound to `port` (an app stopping in a process
    that lives on, as in tests). Unknown ports are ignored."""
    server = _servers.pop(port, None)
    if server is not None:
        server.shutdown()
        server.server_close()
