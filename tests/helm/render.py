"""Render helm/pdserve with the real Helm engine (helm-python-sdk binds Helm's Go SDK; no helm
binary) and give tests the objects, the golden text and the Kubernetes validation they need."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "helm" / "pdserve"
EXAMPLES_DIR = CHART_DIR / "examples"
GOLDEN_DIR = EXAMPLES_DIR / "golden"
RELEASE = "demo"
NAMESPACE = "serving"
FULLNAME = "demo-pdserve"
KUBE_VERSION = "1.33"  # validation schemas (kubernetes-validate) and lint's kube version

# "default" renders the chart's own values.yaml; the others add an examples/<name>.yaml.
CASES = ["default", "gpu-pools", "external-redis", "tracing", "network-policy", "tls"]

# Custom resources: no Kubernetes schema in kubernetes-validate; checked structurally instead.
CRD_API_GROUPS = ("ray.io/", "monitoring.coreos.com/")

_GENERATED_DATA = re.compile(r"(?m)^(  [-._a-zA-Z0-9]+: )[A-Za-z0-9+/]{64}$")


def case_values(case: str) -> dict[str, Any]:
    """The values a case passes on top of the chart's defaults (`helm install -f`)."""
    if case == "default":
        return {}
    return helm.values_from_yaml((EXAMPLES_DIR / f"{case}.yaml").read_text())


@dataclass
class Rendered:
    """One `helm template` run: manifests by template path and the parsed objects."""

    manifests: dict[str, str]

    @property
    def objects(self) -> list[dict[str, Any]]:
        docs = []
        for path in sorted(self.manifests):
            if path.endswith(".yaml"):
                docs += [d for d in yaml.safe_load_all(self.manifests[path]) if d]
        return docs

    def get(self, kind: str, name: str) -> dict[str, Any]:
        for obj in self.objects:
            if obj["kind"] == kind and obj["metadata"]["name"] == name:
                return obj
        raise KeyError(
            f"no {kind} {name}; have {[o['kind'] + '/' + o['metadata']['name'] for o in self.objects]}"
        )

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def golden_text(self) -> str:
        """All rendered templates as `helm template` prints them, with the random values of
        chart-generated Secrets masked (they differ on every offline render)."""
        parts = []
        for path in sorted(self.manifests):
            text = self.manifests[path].strip("\n")
            if not text.strip():
                continue
            docs = []
            for doc in re.split(r"(?m)^---$", text):
                if 'pdserve.io/generated: "true"' in doc:
                    doc = _GENERATED_DATA.sub(r"\1<generated>", doc)
                docs.append(doc.strip("\n"))
            parts.append(f"---\n# Source: {path}\n" + "\n---\n".join(d for d in docs if d.strip()))
        return "\n".join(parts) + "\n"


def render(values: dict[str, Any] | None = None) -> Rendered:
    with helm.Chart.load(CHART_DIR) as chart:
        return Rendered(chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True))


def render_case(case: str) -> Rendered:
    return render(case_values(case))


def validate_kubernetes(obj: dict[str, Any]) -> None:
    """Validate one object against the Kubernetes OpenAPI schemas, strictly (unknown fields
    fail). Raises kubernetes_validate.ValidationError."""
    kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def validate_pod_template(template: dict[str, Any], name: str) -> None:
    """A RayCluster group's pod template, validated as a core/v1 PodTemplate."""
    validate_kubernetes(
        {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": name},
            "template": template,
        }
    )
