"""Values the Helm chart refuses: by its schema, or with a message when it renders."""

from __future__ import annotations

import json

import helm_python as helm
import pytest

from tests.helm.render import (
    CHART_DIR,
    render,
)

# --- values the chart refuses ------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        {"prefill": {"replicas": -1}},
        {"decode": {"minReplicas": -2}},
        {"decode": {"workersPerPod": 0}},
        {"prefill": {"gpus": 1}},  # unknown key in a role block (a typo of gpusPerWorker)
        {"router": {"prot": 50052}},
        {"redis": {"external": {"url": "redis://x"}}},
        {"router": {"port": 70000}},
        {"router": {"shutdownGraceSeconds": -1}},
        {"router": {"tls": {"enabled": "yes"}}},
        {"router": {"tls": {"secretName": "Not_A_Name"}}},
        {"kvTransfer": {"transport": "rdma"}},
        {"kvTransfer": {"tls": {"enabled": True}}},  # TLS without its Secret
        {"kvTransfer": {"tls": {"enabled": True, "secretName": "x", "serverName": "Bad Name"}}},
        {"tracing": {"sampler": "sometimes"}},
        {"prefill": {"rayStartParams": {"num-gpus": 1}}},  # KubeRay wants strings
        {"prefill": {"resources": {"requests": {"cpu": "lots"}}}},
        {"unknownTopLevel": True},
    ],
    ids=lambda bad: json.dumps(bad),
)
def test_schema_rejects_bad_values(bad):
    with helm.Chart.load(CHART_DIR) as chart, pytest.raises(helm.HelmValuesError):
        chart.validate_schema(bad)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"prefill": {"replicas": 5, "maxReplicas": 4}}, "minReplicas <= replicas <= maxReplicas"),
        ({"decode": {"gpusPerWorker": 1}}, "must be equal"),
        ({"decode": {"poolResource": "prefill_pool"}}, "must differ"),
        ({"model": {"pvc": {"claimName": "w"}, "hostPath": "/m"}}, "not both"),
        ({"prefill": {"rayStartParams": {"resources": "x"}}}, "set by the chart"),
        ({"router": {"tls": {"enabled": True}}}, "needs router.tls.secretName"),
        ({"router": {"tls": {"requireClientCert": True}}}, "needs router.tls.enabled"),
        (
            {"router": {"tls": {"enabled": True, "secretName": "t", "healthPort": 9090}}},
            "healthPort must differ",
        ),
    ],
)
def test_render_fails_with_a_message_on_inconsistent_values(bad, message):
    with pytest.raises(helm.HelmRenderError, match=message):
        render(bad)
