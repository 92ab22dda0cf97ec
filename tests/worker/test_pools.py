"""Worker actors get their settings, the KV secret included, as a constructor argument: Ray
logs a runtime_env in clear (runtime_env_agent.log), a constructor argument it does not."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from pdserve.config import KVTransferConfig, ServeConfig, WorkerConfig
from pdserve.engine_config import EngineConfig
from pdserve.worker.pools import create_workers, forwarded_env


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
