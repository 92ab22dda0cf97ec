"""The chart's kvCache values reach `pdserve serve`: the host tier (--kv-offload-gb) and the
disk tier (--kv-disk-dir, --kv-disk-gb, on an emptyDir of every worker pod)."""

from __future__ import annotations

import helm_python as helm
import pytest

from tests.helm.chart_views import container, raycluster_of, router_argv
from tests.helm.render import CHART_DIR, render
from tests.helm.test_chart_kv_transport import parsed


def test_host_tier_size_reaches_pdserve_serve():
    argv = router_argv(render({"kvCache": {"offloadGb": 2.5}}))
    assert parsed(argv).engine.kv_offload_gb == 2.5


def test_host_tier_is_off_by_default():
    argv = router_argv(render({}))
    assert "--kv-offload-gb" not in argv
    assert parsed(argv).engine.kv_offload_gb == 0


@pytest.mark.parametrize("bad", [-1, "4G"])
def test_schema_rejects_a_bad_host_tier_size(bad):
    with helm.Chart.load(CHART_DIR) as chart, pytest.raises(helm.HelmValuesError):
        chart.validate_schema({"kvCache": {"offloadGb": bad}})


def test_disk_tier_reaches_pdserve_serve_and_every_worker_pod_mounts_it():
    objects = render({"kvCache": {"offloadGb": 1, "diskGb": 4}})
    engine = parsed(router_argv(objects)).engine
    assert engine.kv_disk_gb == 4 and engine.kv_disk_dir == "/var/lib/pdserve/kv-disk"
    groups = raycluster_of(objects)["spec"]["workerGroupSpecs"]
    assert len(groups) == 2
    for group in groups:
        pod = group["template"]["spec"]
        mounts = {m["name"]: m["mountPath"] for m in container(pod, "ray-worker")["volumeMounts"]}
        assert mounts["kv-disk"] == engine.kv_disk_dir
        (volume,) = [v for v in pod["volumes"] if v["name"] == "kv-disk"]
        assert volume["emptyDir"]["sizeLimit"] == "4Gi"  # one worker per pod by default


def test_disk_tier_is_off_by_default():
    objects = render({})
    assert "--kv-disk-dir" not in router_argv(objects)
    for group in raycluster_of(objects)["spec"]["workerGroupSpecs"]:
        assert all(v["name"] != "kv-disk" for v in group["template"]["spec"]["volumes"])
