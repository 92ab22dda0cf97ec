"""Benchmarks (`pdserve bench ...`); each prints ratios against a baseline run in the same run.

- `datasets.py` — workloads: random, shared-prefix, mixed, sharegpt:FILE (pure functions of
  their settings and seed).
- `load_generator.py` — open-loop (gamma arrivals) or closed-loop load over the gRPC API,
  recording client-side timestamps.
- `openai_load.py` — the same load over any OpenAI-compatible server's streaming
  /v1/completions (`bench serve --backend openai`).
- `metrics.py` — per-request TTFT/TPOT/ITL/E2E, summaries, SLO goodput (DistServe's definition).
- `report.py`, `plots.py` — rich tables, JSON, latency CDF plots.
- `serve_bench.py` — `bench serve`: the harness against a running server.
- `local_system.py` — what the system benchmarks share: model, mixed workload, local Ray,
  a served system on this machine with pinned workers.
- `compare_bench.py` — `bench compare`: disaggregated vs colocated on the same cores.
- `router_bench.py` — `bench router`: the cost policy vs round-robin.
- `engine_bench.py` — `bench engine`: decode tokens/s vs transformers; `--profile-out` fits
  a sim timing profile.
- `step_recorder.py` — records an engine's steps (work, seconds) and fits them into a
  `--sim-profile` file.
- `transfer_bench.py` — `bench transfer`: KV transfer GB/s vs raw TCP.
- `tracing_bench.py`, `span_receiver.py` — `bench tracing`: latency with tracing on vs off.
- `api_bench.py` — `bench api`: OpenAI HTTP vs gRPC streaming TTFT and ITL, one system.
- `soak_bench.py` — `bench soak`: does memory or anything held grow under sustained load?
- `system_probe.py` — a served system's processes and leftovers (blocks, reservations).
"""
