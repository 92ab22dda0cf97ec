"""`pdserve serve` flags of the client API edge: TLS files, drain time, metrics address."""

from __future__ import annotations

import pytest

from pdserve.cli import build_parser
from pdserve.commands import CommandError
from pdserve.commands.serve import serve_config


def parsed(*flags: str):
    return serve_config(build_parser(["serve"]).parse_args(["serve", *flags]))


def test_edge_flags_reach_the_config():
    config = parsed(
        "--tls-cert", "api.crt", "--tls-key", "api.key", "--tls-client-ca", "clients.pem",
        "--shutdown-grace-s", "120", "--metrics-host", "127.0.0.1", "--health-port", "50052",
        "--max-prompt-bytes", "65536", "--metrics-tls",
    )  # fmt: skip
    router = config.router
    assert (router.tls_cert, router.tls_key, router.tls_client_ca) == (
        "api.crt",
        "api.key",
        "clients.pem",
    )
    assert router.shutdown_grace_s == 120.0
    assert router.health_port == 50052 and router.max_prompt_bytes == 65536
    assert config.metrics_host == "127.0.0.1" and config.metrics_tls
    defaults = parsed()
    assert defaults.router.tls_cert is None and defaults.metrics_host == "0.0.0.0"
    assert not defaults.metrics_tls


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tls-cert", "api.crt"], "--tls-key: --tls-cert and --tls-key go together"),
        (["--tls-client-ca", "c.pem"], "--tls-client-ca: needs --tls-cert and --tls-key"),
        (["--shutdown-grace-s", "-1"], "--shutdown-grace-s: must be at least 0"),
        (["--metrics-tls"], "--metrics-tls: needs --tls-cert and --tls-key"),
    ],
)
def test_incomplete_tls_and_negative_grace_are_refused(flags, message):
    with pytest.raises(CommandError) as error:
        parsed(*flags)
    assert str(error.value).startswith(message)
