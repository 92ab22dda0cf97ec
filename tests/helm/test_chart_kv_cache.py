"""The chart's kvCache values reach `pdserve serve`: the host tier (--kv-offload-gb)."""

from __future__ import annotations

import helm_python as helm
import pytest

from tests.helm.chart_views import router_argv
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
