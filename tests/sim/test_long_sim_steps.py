"""A sim worker busy in one long scaled step (a large prefill chunk x --sim-time-scale) stays
healthy: the router's stats poll waits for the step as long as it waits for progress."""

from __future__ import annotations

import threading
import time

from pdserve.bench.simulation.sim_run import SimCluster, run_sim_load, serve_sim
from pdserve.workloads.datasets import BenchRequest


def test_a_step_longer_than_five_seconds_does_not_mark_its_worker_unhealthy(
    ray_cluster, sim_model_dir
):
    # A 2048-token prefill of Llama-3.1-8B on an H100 is modelled at ~51 ms: 6 s at scale 120.
    scale = 120.0
    cluster = SimCluster(
        prefill_workers=0,
        decode_workers=1,
        time_scale=scale,
        block_size=4,
        num_kv_blocks=1024,
        disaggregate="never",
    )
    prompt = [5 + i % 1000 for i in range(2048)]
    with serve_sim(sim_model_dir, cluster) as app:
        worker = next(iter(app.app.pool.workers.values()))
        unhealthy: list[float] = []
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                if not worker.healthy:
                    unhealthy.append(time.monotonic())
                time.sleep(0.1)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            started = time.monotonic()
            records = run_sim_load(app, [BenchRequest(prompt, len(prompt), 2)], 1.0, scale)
            wall = time.monotonic() - started
        finally:
            done.set()
            watcher.join()
    assert records[0].ok and records[0].output_tokens == 2
    assert wall > 6.0  # the prefill step alone outlasted the default 5 s poll timeout
    assert records[0].ttft > 0.05  # in simulated seconds: the modelled prefill, not 6 s
    assert unhealthy == []
