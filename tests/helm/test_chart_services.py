"""The Helm chart around the RayCluster: secrets, Redis, tracing, network policies, disruption
budgets and the helm test pod."""

from __future__ import annotations

import helm_python as helm
import pytest

from tests.helm.chart_views import (
    container,
    env_of,
    flag,
    merged,
    raycluster,
    rendered,
    router_argv,
)
from tests.helm.render import (
    CASES,
    CHART_DIR,
    FULLNAME,
    render,
)

# --- secrets, Redis, tracing --------------------------------------------------------------------


def pdserve_containers(case: str) -> dict[str, dict]:
    spec = raycluster(case)["spec"]
    found = {c["name"]: c for c in spec["headGroupSpec"]["template"]["spec"]["containers"]}
    for group in spec["workerGroupSpecs"]:
        found[group["groupName"]] = container(group["template"]["spec"], "ray-worker")
    return found


@pytest.mark.parametrize("case", CASES)
def test_secrets_reach_only_the_containers_that_use_them(case):
    values = merged(case)
    secrets = {s["metadata"]["name"]: s for s in rendered(case).all("Secret")}
    for name, c in pdserve_containers(case).items():
        env = env_of(c)
        # The router hands the KV secret to the actors; workers verify/send with it; the Ray
        # head runs no pdserve code. Redis and API keys are the router's alone.
        assert ("PDSERVE_KV_SECRET" in env) == (name != "ray-head")
        assert ("PDSERVE_REDIS_URL" in env) == (name == "router")
        assert ("PDSERVE_API_KEYS" in env) == (
            name == "router" and values["router"]["apiKeys"]["enabled"]
        )
        for var in ("PDSERVE_KV_SECRET", "PDSERVE_API_KEYS", "REDIS_PASSWORD"):
            assert var not in env or "secretKeyRef" in env[var]["valueFrom"]
        if name == "ray-head":
            continue
        kv = env["PDSERVE_KV_SECRET"]["valueFrom"]["secretKeyRef"]
        assert kv["key"] == values["kvTransfer"]["secretKey"]
        if values["kvTransfer"]["existingSecret"]:
            assert (
                kv["name"] == values["kvTransfer"]["existingSecret"] and kv["name"] not in secrets
            )
        else:
            assert values["kvTransfer"]["secretKey"] in secrets[kv["name"]]["data"]


def test_external_redis_reads_the_url_from_the_users_secret_and_bundles_nothing():
    objects = rendered("external-redis")
    assert not [o for o in objects.objects if o["metadata"]["name"].endswith("-redis")]
    assert not objects.all("Secret")  # every secret is the user's
    ref = env_of(pdserve_containers("external-redis")["router"])["PDSERVE_REDIS_URL"]["valueFrom"]
    assert ref["secretKeyRef"] == {"name": "pdserve-redis", "key": "redis-url"}


def test_bundled_redis_is_password_protected_from_a_secret():
    objects = rendered("default")
    redis = objects.get("Deployment", f"{FULLNAME}-redis")["spec"]["template"]["spec"]
    args = container(redis, "redis")["args"]
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    ref = env_of(container(redis, "redis"))["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == f"{FULLNAME}-redis"
    url = env_of(pdserve_containers("default")["router"])["PDSERVE_REDIS_URL"]["value"]
    assert url == f"redis://:$(REDIS_PASSWORD)@{FULLNAME}-redis:6379/0"
    assert objects.get("Service", f"{FULLNAME}-redis")["spec"]["ports"][0]["port"] == 6379


def test_redis_disabled_without_a_url_secret_is_rejected():
    with pytest.raises(helm.HelmValuesError, match="existingSecret"):
        render({"redis": {"enabled": False}})


@pytest.mark.parametrize("case", CASES)
def test_tracing_settings_reach_every_pdserve_container(case):
    tracing = merged(case)["tracing"]
    for name, c in pdserve_containers(case).items():
        env = {k: e.get("value") for k, e in env_of(c).items()}
        assert env["OTEL_SERVICE_NAME"] == tracing["serviceName"]
        # Pod attributes only on Ray containers: the router copies its OTEL_* into the actors.
        role = {"ray-head": "head", "router": None}.get(name, name)
        if role:
            assert env["OTEL_RESOURCE_ATTRIBUTES"].endswith(f"pdserve.role={role}")
        else:
            assert "OTEL_RESOURCE_ATTRIBUTES" not in env
        if tracing["enabled"]:
            assert env["OTEL_TRACES_EXPORTER"] == "otlp"
            assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == tracing["otlpEndpoint"]
            assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == tracing["otlpProtocol"]
            assert env["OTEL_TRACES_SAMPLER"] == tracing["sampler"]
            assert env["OTEL_TRACES_SAMPLER_ARG"] == str(tracing["samplerArg"])
        else:
            assert env["OTEL_TRACES_EXPORTER"] == "none"
            assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in env


def test_service_monitor_scrapes_the_router_metrics_port():
    monitor = rendered("tracing").get("ServiceMonitor", f"{FULLNAME}-router")
    service = rendered("tracing").get("Service", f"{FULLNAME}-router")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert not rendered("default").all("ServiceMonitor")


# --- network policy, disruption budgets, helm test ----------------------------------------------


def test_network_policies_admit_clients_only_to_the_router_ports():
    policies = {
        p["metadata"]["name"]: p["spec"] for p in rendered("network-policy").all("NetworkPolicy")
    }
    assert set(policies) == {f"{FULLNAME}-head", f"{FULLNAME}-workers", f"{FULLNAME}-redis"}
    ray_pods = {
        "key": "app.kubernetes.io/component",
        "operator": "In",
        "values": ["head", "prefill", "decode"],
    }

    def only_ray_pods(rule):
        return [p["podSelector"]["matchExpressions"] for p in rule["from"]] == [[ray_pods]]

    # Workers (Ray ports and the decode workers' KV ports): this RayCluster's pods only.
    (worker_rule,) = policies[f"{FULLNAME}-workers"]["ingress"]
    assert only_ray_pods(worker_rule) and "ports" not in worker_rule
    # Redis: only the Ray pods, only the Redis port.
    (redis_rule,) = policies[f"{FULLNAME}-redis"]["ingress"]
    assert only_ray_pods(redis_rule) and redis_rule["ports"] == [
        {"port": "redis", "protocol": "TCP"}
    ]
    # Head: Ray pods on any port; everyone else only on named router ports (or extra rules).
    head_rules = policies[f"{FULLNAME}-head"]["ingress"]
    assert only_ray_pods(head_rules[0])
    grpc_rule, metrics_rule, dashboard_rule = head_rules[1:]
    assert grpc_rule["ports"] == [
        {"port": "grpc", "protocol": "TCP"},
        {"port": "http", "protocol": "TCP"},
    ]
    assert (
        grpc_rule["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "test"
    )
    assert grpc_rule["from"][1]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "gateway"
    }
    assert metrics_rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    assert dashboard_rule["ports"] == [{"port": 8265, "protocol": "TCP"}]
    assert not rendered("default").all("NetworkPolicy")


def test_network_policies_select_the_pods_they_protect():
    cluster = raycluster("network-policy")["spec"]
    labels = {"head": cluster["headGroupSpec"]["template"]["metadata"]["labels"]}
    for g in cluster["workerGroupSpecs"]:
        labels[g["groupName"]] = g["template"]["metadata"]["labels"]
    policies = {
        p["metadata"]["name"]: p["spec"]["podSelector"]
        for p in rendered("network-policy").all("NetworkPolicy")
    }
    assert policies[f"{FULLNAME}-head"]["matchLabels"].items() <= labels["head"].items()
    workers = policies[f"{FULLNAME}-workers"]
    for role in ("prefill", "decode"):
        assert workers["matchLabels"].items() <= labels[role].items()
        assert (
            labels[role]["app.kubernetes.io/component"] in workers["matchExpressions"][0]["values"]
        )


def test_disruption_budgets_per_role_select_their_pools():
    budgets = {
        b["metadata"]["name"]: b["spec"] for b in rendered("gpu-pools").all("PodDisruptionBudget")
    }
    assert budgets[f"{FULLNAME}-prefill"]["maxUnavailable"] == 1
    assert budgets[f"{FULLNAME}-decode"]["maxUnavailable"] == "25%"
    assert (
        budgets[f"{FULLNAME}-decode"]["selector"]["matchLabels"]["app.kubernetes.io/component"]
        == "decode"
    )
    assert not rendered("default").all("PodDisruptionBudget")


def test_helm_test_pod_checks_grpc_health_through_the_router_service():
    pod = rendered("default").get("Pod", f"{FULLNAME}-test-health")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    c = pod["spec"]["containers"][0]
    assert (
        c["image"]
        == container(raycluster("default")["spec"]["headGroupSpec"]["template"]["spec"], "router")[
            "image"
        ]
    )
    assert env_of(c)["TARGET"]["value"] == f"{FULLNAME}-router:50051"
    script = c["args"][0]
    compile(script, "helm-test", "exec")  # the probe script is valid Python
    assert "HealthStub" in script and "SERVING" in script


def test_the_online_planner_is_off_by_default_and_its_interval_reaches_the_router():
    assert "--plan-interval" not in router_argv(render())
    argv = router_argv(render({"router": {"planIntervalSeconds": 60}}))
    assert flag(argv, "--plan-interval") == "60"
    with helm.Chart.load(CHART_DIR) as chart, pytest.raises(helm.HelmValuesError):
        chart.validate_schema({"router": {"planIntervalSeconds": -1}})


def test_role_switching_is_off_by_default_and_its_settings_reach_the_router():
    assert "--role-switching" not in router_argv(render())
    values = {
        "planIntervalSeconds": 30,
        "roleSwitching": {"enabled": True, "dwellSeconds": 120, "margin": 0.2},
    }
    argv = router_argv(render({"router": values}))
    assert "--role-switching" in argv
    assert flag(argv, "--role-switch-dwell-s") == "120"
    assert flag(argv, "--role-switch-margin") == "0.2"
    assert flag(argv, "--role-switch-drain-s") == "30"
    with helm.Chart.load(CHART_DIR) as chart, pytest.raises(helm.HelmValuesError):
        chart.validate_schema({"router": {"roleSwitching": {"dwellSeconds": -1}}})


def test_peer_pull_is_off_by_default_and_reaches_the_router_when_on():
    assert "--peer-pull" not in router_argv(render())
    assert "--peer-pull" in router_argv(render({"router": {"peerPull": True}}))
    with helm.Chart.load(CHART_DIR) as chart, pytest.raises(helm.HelmValuesError):
        chart.validate_schema({"router": {"peerPull": "yes"}})


def test_hybrid_workers_are_off_by_default_and_reach_the_router_when_on():
    assert "--hybrid" not in router_argv(render())
    assert "--hybrid" in router_argv(render({"router": {"hybrid": True}}))
    with helm.Chart.load(CHART_DIR) as chart, pytest.raises(helm.HelmValuesError):
        chart.validate_schema({"router": {"hybrid": "yes"}})
