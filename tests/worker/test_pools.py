"""Worker actors get their settings, the KV secret included, as a constructor argument: Ray
logs a runtime_env in clear (runtime_env_agent.log), a constructor argument it does not."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from pdserve.config import KVTransferConfig, ServeConfig, WorkerConfig
from pdserve.engine_config import EngineConfig
from pdserve.models.builtin import builtin_model_dir
from pdserve.startup_checks import StartupError
from pdserve.worker.pools import create_workers, forwarded_env, worker_spec
from pdserve.worker.tp_placement import check_tensor_parallel


def session_files_containing(ray, text: str) -> list[str]:
    session = Path(ray._private.worker._global_node.get_session_dir_path())
    return [
        str(path.relative_to(session))
        for path in session.rglob("*")
        if path.is_file() and text.encode() in path.read_bytes()
    ]


@pytest.fixture()
def workers(ray_cluster, monkeypatch):
    secret = "kv-secret-" + secrets.token_hex(12)
    # What a deployment puts in the router's environment: documented inputs of that process.
    monkeypatch.setenv("PDSERVE_KV_SECRET", secret)
    monkeypatch.setenv("PDSERVE_API_KEYS", "client-key-" + secret)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    config = ServeConfig(
        engine=EngineConfig(block_size=4, num_kv_blocks=16, num_threads=1),
        kv=KVTransferConfig(secret=secret, bind_host="127.0.0.1", advertise_host="127.0.0.1"),
        worker=WorkerConfig(metrics_port=0, fault_injection=True),
    )
    prefill, decode = create_workers(config, None)
    handles = {**prefill, **decode}
    try:
        yield secret, handles
    finally:
        for handle in handles.values():
            ray_cluster.kill(handle, no_restart=True)


def test_the_secret_never_reaches_rays_logs(workers, ray_cluster):
    secret, handles = workers
    answers = ray_cluster.get([h.ready.remote() for h in handles.values()], timeout=300)
    # The decode worker's KV receiver needs the secret to start: it got it.
    assert [bool(a.get("kv_endpoint")) for a in answers] == [False, True]
    # The typed WorkerConfig arrived: a metrics endpoint on an ephemeral port, faults armable.
    assert all(a["metrics_port"] for a in answers)
    ray_cluster.get(handles["prefill-0"].inject_fault.remote("none"), timeout=60)
    assert session_files_containing(ray_cluster, secret) == []


def test_only_opentelemetry_variables_are_forwarded(monkeypatch):
    monkeypatch.setenv("PDSERVE_KV_SECRET", "s")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "router")
    env = forwarded_env()
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://collector:4317"
    assert not [k for k in env if not k.startswith("OTEL_")]
    assert "OTEL_SERVICE_NAME" not in env


def _node(resource: str, cpus: float, gpus: float = 0, alive: bool = True) -> dict:
    return {"Alive": alive, "Resources": {resource: 4, "CPU": cpus, "GPU": gpus}}


@pytest.mark.parametrize(
    ("flags", "nodes", "message"),
    [
        (  # the built-in model has 4 attention heads
            dict(decode_tp=3),
            [_node("decode_pool", 8)],
            "--decode-tp: tensor parallel degree 3 does not divide num_attention_heads 4",
        ),
        (
            dict(decode_tp=4, gpus_per_worker=1),
            [_node("decode_pool", 16, gpus=2), _node("prefill_pool", 16, gpus=8)],
            "--decode-tp 4: a worker needs 4 GPUs and 0 CPUs on one node (4 ranks x "
            "--gpus-per-worker 1 / --cpus-per-worker 0); the decode_pool nodes have at most "
            "2 GPUs and 16 CPUs",
        ),
        (  # CPU ranks: a core each at least
            dict(prefill_tp=4),
            [_node("prefill_pool", 2), _node("prefill_pool", 8, alive=False)],
            "--prefill-tp 4: a worker needs 0 GPUs and 4 CPUs on one node",
        ),
    ],
)
def test_a_tp_that_cannot_work_is_one_line_naming_the_flag(flags, nodes, message):
    config = ServeConfig(engine=EngineConfig(num_threads=1), **flags)
    with pytest.raises(StartupError) as error:
        check_tensor_parallel(config, builtin_model_dir(), nodes)
    assert str(error.value).startswith(message)


def test_expert_parallel_on_a_model_without_experts_is_refused_naming_the_flag():
    config = ServeConfig(engine=EngineConfig(num_threads=1), decode_tp=2, expert_parallel=True)
    with pytest.raises(StartupError) as error:
        check_tensor_parallel(config, builtin_model_dir(), [_node("decode_pool", 2)])
    assert str(error.value).startswith("--expert-parallel: ")
    assert "declares no experts (neither num_experts nor num_local_experts)" in str(error.value)


def test_expert_parallel_reaches_the_specs_of_the_tp_pools():
    """What each worker (and its rank actors: rank_group.py) is started with."""
    config = ServeConfig(prefill_tp=2, expert_parallel=True)
    assert worker_spec(config, None, 0, "prefill").engine.expert_parallel
    assert not worker_spec(config, None, 1, "decode").engine.expert_parallel  # TP 1


def test_a_tp_that_fits_passes_and_tp_1_is_not_checked():
    config = ServeConfig(engine=EngineConfig(num_threads=1), prefill_tp=2, decode_tp=2)
    check_tensor_parallel(
        config, builtin_model_dir(), [_node("prefill_pool", 2), _node("decode_pool", 2)]
    )
    check_tensor_parallel(ServeConfig(), builtin_model_dir(), [])  # TP 1: nothing to check
