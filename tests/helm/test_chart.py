"""The Helm chart: it lints clean, renders valid Kubernetes objects for the default values and
every example, and builds the RayCluster the values ask for."""

from __future__ import annotations

import json
import shlex

import helm_python as helm
import kubernetes_validate
import pytest

from tests.helm.chart_views import (
    container,
    env_of,
    flag,
    merged,
    raycluster,
    rendered,
    router_argv,
    serve_argv,
)
from tests.helm.render import (
    CASES,
    CHART_DIR,
    CRD_API_GROUPS,
    FULLNAME,
    KUBE_VERSION,
    case_values,
    render,
    validate_kubernetes,
    validate_pod_template,
)

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
        gpus = want["workersPerPod"] * want["tp"] * want["gpusPerWorker"]  # GPUs of every rank
        limits, requests = worker["resources"].get("limits", {}), worker["resources"]["requests"]
        assert limits.get("nvidia.com/gpu", 0) == requests.get("nvidia.com/gpu", 0) == gpus
        assert requests["cpu"] == want["resources"]["requests"]["cpu"]
        assert "command" not in worker  # KubeRay runs `ray start` from rayStartParams


def test_gpu_pools_example_requests_gpus_on_gpu_nodes():
    groups = {g["groupName"]: g for g in raycluster("gpu-pools")["spec"]["workerGroupSpecs"]}
    decode = container(groups["decode"]["template"]["spec"], "ray-worker")
    assert decode["resources"]["limits"]["nvidia.com/gpu"] == 4  # 2 workers of TP 2
    assert groups["prefill"]["template"]["spec"]["nodeSelector"] == {
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"
    }
    argv = serve_argv("gpu-pools")
    assert flag(argv, "--gpus-per-worker") == "1"
    assert flag(argv, "--decode-tp") == "2"
    assert "--prefill-tp" not in argv  # TP 1: the default, no flag
    assert flag(argv, "--kv-transport") == "collective"
    assert flag(argv, "--model") == "/models/Llama-3.1-8B-Instruct"


def test_expert_parallel_value_passes_the_flag_and_is_off_by_default():
    argv = router_argv(render({"model": {"expertParallel": True}, "decode": {"tp": 2}}))
    assert "--expert-parallel" in argv
    assert flag(argv, "--decode-tp") == "2"
    assert "--expert-parallel" not in router_argv(render({}))


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
