"""Views into a rendered chart shared by the Helm tests: the RayCluster, its pods and
containers, and the router's `pdserve serve` argv."""

from __future__ import annotations

from functools import cache

import helm_python as helm

from tests.helm.render import CHART_DIR, FULLNAME, Rendered, case_values, render_case


@cache
def rendered(case: str) -> Rendered:
    return render_case(case)


@cache
def merged(case: str) -> dict:
    with helm.Chart.load(CHART_DIR) as chart:
        return chart.merge_values(case_values(case))


def raycluster_of(objects: Rendered) -> dict:
    return objects.get("RayCluster", FULLNAME)


def raycluster(case: str) -> dict:
    return raycluster_of(rendered(case))


def head_pod(objects: Rendered) -> dict:
    """The head pod's spec (ray-head and the router container)."""
    return raycluster_of(objects)["spec"]["headGroupSpec"]["template"]["spec"]


def container(pod_spec: dict, name: str) -> dict:
    return next(c for c in pod_spec["containers"] if c["name"] == name)


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def router_argv(objects: Rendered) -> list[str]:
    """The router's `pdserve serve` argv (after the bash wait-for-Ray wrapper and its $0)."""
    router = container(head_pod(objects), "router")
    assert router["command"] == ["/bin/bash", "-c"]
    assert 'exec "$@"' in router["args"][0]
    return router["args"][2:]


def serve_argv(case: str) -> list[str]:
    return router_argv(rendered(case))


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None
