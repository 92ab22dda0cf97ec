"""The UCX settings `make_agent` puts into the environment before an agent's backend starts."""

from __future__ import annotations

import os

import pytest

from kv_transfer.nixl_agent import UCX_TUNING, make_agent

pytest.importorskip("nixl_cu12")


@pytest.fixture
def clean_ucx_env(monkeypatch):
    for name in ("UCX_TLS", *UCX_TUNING):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_agents_get_large_tcp_segments_and_the_transports_asked_for(clean_ucx_env):
    # 8 KiB segments made a READ over UCX TCP 0.3 of raw TCP (docs/kv_transfer.md).
    make_agent("env-default", "tcp")
    assert os.environ["UCX_TLS"] == "tcp"
    assert {name: os.environ[name] for name in UCX_TUNING} == UCX_TUNING


def test_segment_sizes_set_by_the_operator_win(clean_ucx_env):
    clean_ucx_env.setenv("UCX_TCP_TX_SEG_SIZE", "64k")
    make_agent("env-operator", "tcp")
    assert os.environ["UCX_TCP_TX_SEG_SIZE"] == "64k"
    # Both or neither: a receive segment must hold a whole sent one.
    assert "UCX_TCP_RX_SEG_SIZE" not in os.environ
