"""`pdserve serve`'s checks before anything slow starts: a taken port and a dtype the CPU cannot
run are one line each, naming the flag, within seconds."""

from __future__ import annotations

import socket

import pytest

from pdserve.config import ServeConfig
from pdserve.dtype_probe import HIDE_ENV, check_dtype
from pdserve.ray_cluster import check_pool_resources
from pdserve.startup_checks import StartupError
from tests.test_cli import model_dir, run_pdserve  # noqa: F401 - the fixture

PORT_CHECK_S = 10.0


@pytest.fixture()
def taken_port():
    """A port another process listens on (as a second server would)."""
    with socket.socket() as squatter:
        squatter.bind(("0.0.0.0", 0))
        squatter.listen()
        yield squatter.getsockname()[1]


@pytest.mark.parametrize("flag", ["--http-port", "--metrics-port", "--worker-metrics-port"])
def test_a_taken_port_is_one_line_naming_its_flag(model_dir, taken_port, flag):  # noqa: F811
    ports = {"--port": "0", "--http-port": "0", flag: str(taken_port)}
    argv = [item for pair in ports.items() for item in pair]
    code, lines, seconds = run_pdserve("serve", "--model", str(model_dir), *argv)
    assert (code, lines) == (
        1,
        [
            f"pdserve serve: error: port {taken_port} ({flag}) is in use; pick another with "
            f"{flag} or 0 for any free port"
        ],
    )
    assert seconds < PORT_CHECK_S


def test_a_dtype_the_cpu_lacks_is_one_line_naming_the_feature(model_dir):  # noqa: F811
    code, lines, seconds = run_pdserve(
        "serve",
        "--model",
        str(model_dir),
        "--port",
        "0",
        "--http-port",
        "0",
        "--dtype",
        "bfloat16",
        # Every flag of both alternatives hidden: what is missing is then the same on any CPU
        # (an AMD EPYC without AVX-512 lacks avx512dq and avx512vl too).
        env={HIDE_ENV: "avx512bw,avx512dq,avx512vl,avx_ne_convert"},
    )
    assert (code, lines) == (
        1,
        [
            "pdserve serve: error: --dtype bfloat16 on this CPU needs AVX-512 BW/VL/DQ or "
            "AVX-NE-CONVERT (missing: avx512bw, avx512dq, avx512vl, avx_ne_convert); use "
            "--dtype float32"
        ],
    )
    assert seconds < PORT_CHECK_S * 2


def test_the_probe_runs_the_dtype_through_the_models_linear(monkeypatch):
    monkeypatch.delenv(HIDE_ENV, raising=False)
    check_dtype("float32", "cpu")  # runs: no error
    with pytest.raises(StartupError, match=r"^--dtype float32 on cuda:7: .*"):
        check_dtype("float32", "cuda:7")  # no such device on this machine


def test_a_cluster_without_the_pools_resources_is_one_line():
    config = ServeConfig(ray_address="10.0.0.1:6379", decode_workers=2, cpus_per_worker=1)
    check_pool_resources(config, {"CPU": 8, "prefill_pool": 1, "decode_pool": 2})
    with pytest.raises(StartupError) as refused:
        check_pool_resources(config, {"CPU": 8, "decode_pool": 1})
    assert str(refused.value) == (
        "--ray-address 10.0.0.1:6379: the cluster lacks the pools' resources: needs "
        "prefill_pool 1, decode_pool 2, CPU 3; has prefill_pool 0, decode_pool 1, CPU 8 "
        "(see --prefill-pool-resource, --decode-pool-resource)"
    )
