"""The chart's side of the OpenAI-compatible HTTP API: the port on the router container and
Service, the flag, and the router's probes over HTTP when asked for."""

from __future__ import annotations

import json
import re

import helm_python as helm
import pytest
from prometheus_client import REGISTRY

import pdserve.metrics  # noqa: F401 (registers the metrics)
from tests.helm.chart_views import container, head_pod, raycluster_of
from tests.helm.render import (
    CHART_DIR,
    FULLNAME,
    render,
    validate_kubernetes,
    validate_pod_template,
)

TLS = {"enabled": True, "secretName": "api-tls"}


def head(values: dict) -> dict:
    return raycluster_of(render(values))["spec"]["headGroupSpec"]["template"]


def router(values: dict) -> dict:
    return container(head_pod(render(values)), "router")


def test_the_http_port_is_served_and_exposed() -> None:
    rendered = render({"router": {"httpPort": 8080}})
    service = rendered.get("Service", f"{FULLNAME}-router")
    http = next(p for p in service["spec"]["ports"] if p["name"] == "http")
    assert http == {"name": "http", "port": 8080, "targetPort": "http", "appProtocol": "http"}
    container = router({"router": {"httpPort": 8080}})
    assert {"name": "http", "containerPort": 8080} in container["ports"]
    argv = container["args"]
    assert argv[argv.index("--http-port") + 1] == "8080"


def test_grpc_probes_stay_the_default() -> None:
    container = router({})
    assert set(container["readinessProbe"]) >= {"grpc"}
    assert "httpGet" not in container["livenessProbe"]


@pytest.mark.parametrize(("tls", "scheme"), [({}, "HTTP"), (TLS, "HTTPS")])
def test_http_probes_ask_health_and_ready(tls, scheme) -> None:
    values = {"router": {"probeProtocol": "http", "tls": tls}}
    container = router(values)
    paths = {"startupProbe": "/health", "livenessProbe": "/health", "readinessProbe": "/ready"}
    for probe, path in paths.items():
        assert container[probe]["httpGet"] == {"path": path, "port": "http", "scheme": scheme}
        assert "grpc" not in container[probe] and "service" not in container[probe]
    assert container["readinessProbe"]["periodSeconds"] == 5  # the timing values still apply
    validate_pod_template(head(values), "head")
    service = render(values).get("Service", f"{FULLNAME}-router")
    http = next(p for p in service["spec"]["ports"] if p["name"] == "http")
    assert http["appProtocol"] == scheme.lower()


def test_http_probes_with_client_certificates_are_refused() -> None:
    bad = {"router": {"probeProtocol": "http", "tls": {**TLS, "requireClientCert": True}}}
    with helm.Chart.load(CHART_DIR) as chart, pytest.raises(helm.HelmValuesError):
        chart.validate_schema(bad)
    with helm.Chart.load(CHART_DIR) as chart, pytest.raises(helm.HelmValuesError):
        chart.validate_schema({"router": {"probeProtocol": "tcp"}})


@pytest.mark.parametrize(
    "router_values",
    [{"httpPort": 50051}, {"httpPort": 9090}, {"httpPort": 50052, "tls": TLS}],
)
def test_the_http_port_must_not_clash(router_values) -> None:
    with pytest.raises(helm.HelmRenderError, match="httpPort must differ"):
        render({"router": router_values})


def test_the_grafana_dashboard_is_a_configmap_for_the_sidecar_when_enabled() -> None:
    assert not [
        c for c in render({}).all("ConfigMap") if c["metadata"]["name"].endswith("-dashboard")
    ]
    values = {"metrics": {"grafanaDashboard": {"enabled": True, "annotations": {"f": "LLM"}}}}
    config_map = render(values).get("ConfigMap", f"{FULLNAME}-dashboard")
    validate_kubernetes(config_map)
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["annotations"] == {"f": "LLM"}
    dashboard = json.loads(config_map["data"]["pdserve.json"])
    assert dashboard == json.loads((CHART_DIR / "dashboards" / "pdserve.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    # Every vLLM-named metric the router exports is on the dashboard, and nothing else of vLLM's.
    exported = {m.name.removesuffix("_total") for m in REGISTRY.collect()}
    used = set(re.findall(r"vllm:[a-z0-9_]+", exprs))
    used = {re.sub(r"_(total|bucket)$", "", name) for name in used}
    vllm = {name for name in exported if name.startswith("vllm:")}
    assert used == vllm
    # The per-token latencies a vLLM dashboard shows beside TTFT, each with its own panel.
    for metric in ("vllm:time_per_output_token_seconds", "vllm:inter_token_latency_seconds"):
        assert any(metric in t["expr"] for p in dashboard["panels"] for t in p["targets"])
