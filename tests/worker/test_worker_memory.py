"""A live worker reports its peak memory in WorkerStats and its Prometheus gauges, and stays
within its budget: weights + KV pool + memory_usage.PROCESS_ALLOWANCE_BYTES."""

from __future__ import annotations

import urllib.request

import pytest

from pdserve.config import KVTransferConfig, ServeConfig, WorkerConfig
from pdserve.engine_config import EngineConfig
from pdserve.models.builtin import default_model_dir
from pdserve.worker.memory_usage import PROCESS_ALLOWANCE_BYTES, peak_gpu_bytes, peak_rss_bytes
from pdserve.worker.pools import create_workers

KV_CACHE_BYTES = 32 * 2**20


@pytest.fixture()
def prefill_worker(ray_cluster, monkeypatch):
    monkeypatch.setenv("PDSERVE_KV_SECRET", "memory-test-secret")
    config = ServeConfig(
        engine=EngineConfig(block_size=4, kv_cache_bytes=KV_CACHE_BYTES, num_threads=1),
        kv=KVTransferConfig(
            secret="memory-test-secret", bind_host="127.0.0.1", advertise_host="127.0.0.1"
        ),
        worker=WorkerConfig(metrics_port=0),
    )
    prefill, decode = create_workers(config, None)
    try:
        yield next(iter(prefill.values()))
    finally:
        for handle in {**prefill, **decode}.values():
            ray_cluster.kill(handle, no_restart=True)


def test_this_process_reports_its_peak():
    held = bytearray(64 * 2**20)  # touched: resident
    assert peak_rss_bytes() >= len(held)
    assert peak_gpu_bytes() == 0  # no CUDA here


def test_worker_peak_memory_is_reported_and_within_budget(prefill_worker, ray_cluster):
    answer = ray_cluster.get(prefill_worker.ready.remote(), timeout=300)
    stats = ray_cluster.get(prefill_worker.stats.remote(), timeout=60)
    weights = sum(p.stat().st_size for p in default_model_dir().glob("*.safetensors"))
    kv_pool = stats.num_blocks * stats.bytes_per_block
    assert 0 < kv_pool <= KV_CACHE_BYTES
    # At least the interpreter and torch are resident; at most the documented budget.
    assert 100 * 2**20 < stats.peak_rss_bytes <= weights + kv_pool + PROCESS_ALLOWANCE_BYTES
    assert stats.peak_gpu_bytes == 0
    url = f"http://127.0.0.1:{answer['metrics_port']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    gauges = [row for row in text.splitlines() if row.startswith("pdserve_worker_peak_memory")]
    line = f'pdserve_worker_peak_memory_bytes{{kind="rss",worker="{stats.worker_id}"}}'
    assert [float(row.split()[-1]) for row in gauges if row.startswith(line)] == [
        stats.peak_rss_bytes
    ], gauges
