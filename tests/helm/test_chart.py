"""The Helm chart: it lints clean, renders valid Kubernetes objects for the default values and
every example, builds the RayCluster the values ask for, and its schema rejects bad values."""

from __future__ import annotations

import json
import shlex
from functools import cache

import helm_python as helm
import kubernetes_validate
import pytest

from tests.helm.render import (
    CASES,
    CHART_DIR,
    CRD_API_GROUPS,
    FULLNAME,
    KUBE_VERSION,
    Rendered,
    case_values,
    render,
    render_case,
    validate_kubernetes,
    validate_pod_template,
)


@cache
def rendered(case: str) -> Rendered:
    return render_case(case)


@cache
def merged(case: str) -> dict:
    with helm.Chart.load(CHART_DIR) as chart:
        return chart.merge_values(case_values(case))


def raycluster(case: str) -> dict:
    return rendered(case).get("RayCluster", FULLNAME)


def container(pod_spec: dict, name: str) -> dict:
    return next(c for c in pod_spec["containers"] if c["name"] == name)


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def serve_argv(case: str) -> list[str]:
    """The router's `pdserve serve` argv (after the bash wait-for-Ray wrapper and its $0)."""
    router = container(raycluster(case)["spec"]["headGroupSpec"]["template"]["spec"], "router")
    assert router["command"] == ["/bin/bash", "-c"]
    assert 'exec "$@"' in router["args"][0]
    return router["args"][2:]


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


# --- lint and Kubernetes validity -------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_lint_is_clean_in_strict_mode(case):
    report = helm.lint(CHART_DIR, case_values(case), strict=True, kube_version=f"v{KUBE_VERSION}.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems and not report["errors"], report


@pytest.mark.parametrize("case", CASES)
def test_every_object_validates_against_kubernetes_schemas(case):
    for obj in rendered(case).objects:
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        if obj["apiVersion"].startswith(CRD_API_GROUPS):
            continue  # custom resources: checked by the tests below
        try:
            validate_kubernetes(obj)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{case}: {name}: {'.'.join(map(str, error.path))}: {error.message[:300]}")


@pytest.mark.parametrize("case", CASES)
def test_raycluster_pod_templates_are_valid_pod_templates(case):
    spec = raycluster(case)["spec"]
    templates = {"head": spec["headGroupSpec"]["template"]}
    templates |= {g["groupName"]: g["template"] for g in spec["workerGroupSpecs"]}
    for name, template in templates.items():
        try:
            validate_pod_template(template, name)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(
                f"{case}: {name} pod template: {'.'.join(map(str, error.path))}: {error.message[:300]}"
            )


# --- the RayCluster the values ask for ---------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_worker_groups_follow_their_role_values(case):
    values = merged(case)
    cluster = raycluster(case)
    assert cluster["apiVersion"] == "ray.io/v1"
    assert cluster["spec"]["rayVersion"] == values["rayCluster"]["rayVersion"]
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"prefill", "decode"}
    for role, group in groups.items():
        want = values[role]
        assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (
            want["replicas"],
            want["minReplicas"],
            want["maxReplicas"],
        )
        # KubeRay pastes rayStartParams into a shell command line: the value must be a quoted
        # JSON object that the shell turns into {"<pool>": workersPerPod}.
        params = group["rayStartParams"]
        assert all(isinstance(v, str) for v in params.values())
        (word,) = shlex.split(params["resources"])
        assert json.loads(word) == {want["poolResource"]: want["workersPerPod"]}

        pod = group["template"]["spec"]
        assert group["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == role
        assert pod.get("nodeSelector", {}) == want["nodeSelector"]
        assert pod.get("tolerations", []) == want["tolerations"]
        worker = container(pod, "ray-worker")
        gpus = want["workersPerPod"] * want["gpusPerWorker"]
        limits, requests = worker["resources"].get("limits", {}), worker["resources"]["requests"]
        assert limits.get("nvidia.com/gpu", 0) == requests.get("nvidia.com/gpu", 0) == gpus
        assert requests["cpu"] == want["resources"]["requests"]["cpu"]
        assert "command" not in worker  # KubeRay runs `ray start` from rayStartParams


def test_gpu_pools_example_requests_gpus_on_gpu_nodes():
    groups = {g["groupName"]: g for g in raycluster("gpu-pools")["spec"]["workerGroupSpecs"]}
    decode = container(groups["decode"]["template"]["spec"], "ray-worker")
    assert decode["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert groups["prefill"]["template"]["spec"]["nodeSelector"] == {
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"
    }
    argv = serve_argv("gpu-pools")
    assert flag(argv, "--gpus-per-worker") == "1"
    assert flag(argv, "--kv-transport") == "collective"
    assert flag(argv, "--model") == "/models/Llama-3.1-8B-Instruct"


@pytest.mark.parametrize("case", CASES)
def test_router_runs_pdserve_serve_with_the_pool_sizes(case):
    values = merged(case)
    argv = serve_argv(case)
    assert argv[:4] == ["pdserve", "serve", "--ray-address", "auto"]
    workers = {r: values[r]["replicas"] * values[r]["workersPerPod"] for r in ("prefill", "decode")}
    assert flag(argv, "--prefill-workers") == str(workers["prefill"])
    assert flag(argv, "--decode-workers") == str(workers["decode"])
    assert flag(argv, "--port") == str(values["router"]["port"])
    assert flag(argv, "--metrics-port") == str(values["router"]["metricsPort"])
    # The Redis URL (with its password) is in the env, never in argv (visible in ps).
    assert "--redis-url" not in argv
    extra = values["router"]["extraArgs"]
    if extra:
        assert argv[-len(extra) :] == extra


def test_default_model_is_the_builtin_one_and_a_pvc_is_mounted_read_only_everywhere():
    assert "--model" not in serve_argv("default")
    cluster = render({"model": {"pvc": {"claimName": "weights"}, "dir": "qwen"}}).get(
        "RayCluster", FULLNAME
    )
    pods = [cluster["spec"]["headGroupSpec"]["template"]["spec"]]
    pods += [g["template"]["spec"] for g in cluster["spec"]["workerGroupSpecs"]]
    for pod in pods:
        assert {
            "name": "model",
            "persistentVolumeClaim": {"claimName": "weights", "readOnly": True},
        } in pod["volumes"]
        name = "router" if pod is pods[0] else "ray-worker"
        mounts = {m["name"]: m for m in container(pod, name)["volumeMounts"]}
        assert mounts["model"] == {"name": "model", "mountPath": "/models", "readOnly": True}


@pytest.mark.parametrize("case", CASES)
def test_router_service_selects_the_pod_running_the_router_with_grpc_probes(case):
    values = merged(case)
    head = raycluster(case)["spec"]["headGroupSpec"]["template"]
    service = rendered(case).get("Service", f"{FULLNAME}-router")
    labels = head["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    expected = {
        "grpc": values["router"]["port"],
        "metrics": values["router"]["metricsPort"],
        "http": values["router"]["httpPort"],
    }
    tls = values["router"]["tls"]
    if tls["enabled"]:
        expected["health"] = tls["healthPort"]
    assert ports == expected
    router = container(head["spec"], "router")
    assert {p["name"] for p in router["ports"]} == set(expected)
    # The kubelet's gRPC probes speak plaintext: with TLS on they ask the health-only port.
    port = tls["healthPort"] if tls["enabled"] else values["router"]["port"]
    # Liveness asks the overall service (the process answers); readiness asks the Generation
    # service, which is SERVING only while a decode worker is up.
    assert router["livenessProbe"]["grpc"] == {"port": port}
    assert router["startupProbe"]["grpc"] == {"port": port}
    assert router["readinessProbe"]["grpc"] == {"port": port, "service": "pdserve.v1.Generation"}
    # The Ray node is the first container (KubeRay's convention); the router shares /tmp/ray.
    assert head["spec"]["containers"][0]["name"] == "ray-head"
    for c in head["spec"]["containers"]:
        assert {"name": "ray-tmp", "mountPath": "/tmp/ray"} in c["volumeMounts"]


@pytest.mark.parametrize("case", CASES)
def test_the_head_pod_waits_for_the_router_to_drain(case):
    values = merged(case)
    grace = values["router"]["shutdownGraceSeconds"]
    head = raycluster(case)["spec"]["headGroupSpec"]["template"]["spec"]
    assert flag(serve_argv(case), "--shutdown-grace-s") == str(grace)
    assert head["terminationGracePeriodSeconds"] == grace + 15
    # Ray stays up while the router drains: until the router's metrics port closes, at most
    # the drain time.
    script = container(head, "ray-head")["lifecycle"]["preStop"]["exec"]["command"][-1]
    assert f"seq {grace})" in script
    assert f"/dev/tcp/127.0.0.1/{values['router']['metricsPort']})" in script


def test_tls_serves_the_api_from_the_secret_and_probes_plaintext_health():
    head = raycluster("tls")["spec"]["headGroupSpec"]["template"]["spec"]
    argv = serve_argv("tls")
    assert flag(argv, "--tls-cert") == "/etc/pdserve/api-tls/tls.crt"
    assert flag(argv, "--tls-key") == "/etc/pdserve/api-tls/tls.key"
    assert flag(argv, "--tls-client-ca") == "/etc/pdserve/api-client-ca/ca.crt"
    assert flag(argv, "--health-port") == "50052"
    volumes = {v["name"]: v for v in head["volumes"]}
    assert volumes["api-tls"]["secret"]["secretName"] == "pdserve-api-tls"
    # cert-manager writes the issuer's CA into the same Secret as ca.crt.
    assert volumes["api-client-ca"]["secret"] == {
        "secretName": "pdserve-api-tls",
        "items": [{"key": "ca.crt", "path": "ca.crt"}],
    }
    mounts = {m["name"]: m for m in container(head, "router")["volumeMounts"]}
    assert mounts["api-tls"] == {
        "name": "api-tls",
        "mountPath": "/etc/pdserve/api-tls",
        "readOnly": True,
    }
    assert "api-tls" not in {m["name"] for m in container(head, "ray-head")["volumeMounts"]}
    test_pod = rendered("tls").get("Pod", f"{FULLNAME}-test-health")
    assert env_of(test_pod["spec"]["containers"][0])["TARGET"]["value"] == (
        f"{FULLNAME}-router:50052"
    )
    for case in ("default", "gpu-pools"):
        assert flag(serve_argv(case), "--tls-cert") is None


def test_kv_transfer_tls_is_mounted_on_every_worker_and_passed_to_them():
    argv = serve_argv("tls")
    assert flag(argv, "--kv-tls-cert") == "/etc/pdserve/kv-tls/tls.crt"
    assert flag(argv, "--kv-tls-key") == "/etc/pdserve/kv-tls/tls.key"
    assert flag(argv, "--kv-tls-ca") == "/etc/pdserve/kv-tls/ca.crt"
    assert flag(argv, "--kv-tls-server-name") == "pdserve-kv"
    assert "--no-kv-tls-client-auth" not in argv  # mutual TLS unless turned off
    for group in raycluster("tls")["spec"]["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["kv-tls"]["secret"]["secretName"] == "pdserve-kv-tls"
        assert {i["key"] for i in volumes["kv-tls"]["secret"]["items"]} == {
            "tls.crt",
            "tls.key",
            "ca.crt",
        }
        mounts = {m["name"]: m for m in container(pod, "ray-worker")["volumeMounts"]}
        assert mounts["kv-tls"]["mountPath"] == "/etc/pdserve/kv-tls"
    for case in ("default", "gpu-pools"):
        assert flag(serve_argv(case), "--kv-tls-cert") is None


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


# --- the image the chart runs ------------------------------------------------------------------


def test_dockerfile_matches_what_the_chart_assumes():
    dockerfile = (CHART_DIR.parents[1] / "Dockerfile").read_text()
    values = merged("default")
    # KubeRay and every Ray node must agree on the Ray version.
    assert f"ARG RAY_VERSION={values['rayCluster']['rayVersion']}\n" in dockerfile
    # The pods run as the image's non-root user.
    uid = values["podSecurityContext"]["runAsUser"]
    assert f"--uid {uid} " in dockerfile and f"USER {uid}:{uid}" in dockerfile
    # The built-in model is baked in, since the router hands its path to workers on other pods.
    assert "default_model_dir()" in dockerfile
