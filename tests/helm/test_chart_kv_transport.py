"""The chart selects the KV transport, nixl and its UCX transports included, and the router's
`pdserve serve` accepts the flags it renders."""

from __future__ import annotations

import argparse

import helm_python as helm
import pytest

from pdserve.commands import serve
from pdserve.config import ServeConfig
from tests.helm.chart_views import router_argv
from tests.helm.render import CHART_DIR, render


def serve_argv(values: dict) -> list[str]:
    return router_argv(render(values))


def parsed(argv: list[str]) -> ServeConfig:
    """What `pdserve serve` makes of the rendered argv (after `pdserve serve`)."""
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return serve.serve_config(parser.parse_args(argv[2:]))


def test_nixl_transport_and_its_ucx_transports_reach_pdserve_serve():
    argv = serve_argv({"kvTransfer": {"transport": "nixl", "nixlUcxTls": "rc,cuda_ipc"}})
    config = parsed(argv)
    assert (config.kv.transport, config.kv.nixl_ucx_tls) == ("nixl", "rc,cuda_ipc")


def test_ucx_transports_are_left_to_ucx_by_default():
    argv = serve_argv({})
    assert "--kv-nixl-ucx-tls" not in argv
    assert parsed(argv).kv.nixl_ucx_tls is None


@pytest.mark.parametrize("bad", ["tcp;reboot", "TCP", "tcp,"])
def test_schema_rejects_a_malformed_ucx_transport_list(bad):
    with helm.Chart.load(CHART_DIR) as chart, pytest.raises(helm.HelmValuesError):
        chart.validate_schema({"kvTransfer": {"nixlUcxTls": bad}})
