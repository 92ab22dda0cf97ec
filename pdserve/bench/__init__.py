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
- `sim_run.py` — a served system of sim workers: workloads at simulated rates, figures in
  simulated time.
- `sim_saturation.py` — the saturation check that refuses a sim run's figures when the CPU,
  not the timing model, set the pace.
- `sim_disagg_bench.py` — `bench sim-disagg`: every P:D split vs colocated on 8 sim H100s,
  goodput at TTFT/TPOT SLOs (issue 14 5a).
- `sim_routing_bench.py` — `bench sim-routing`: routing policies on 16 and 64 sim workers,
  multi-turn chat (issue 14 5b).
- `engine_bench.py` — `bench engine`: decode tokens/s vs transformers; `--profile-out` fits
  a sim timing profile.
- `mixed_engine_bench.py` — `bench engine-mixed`: requests/s on ShareGPT-like mixed lengths,
  continuous batching vs transformers' `generate` in static batches.
- `spec_bench.py` — `bench spec`: decode tokens/s without speculation, with ngram and with a
  draft model, acceptance, cost ratio and the analytical limit; `spec_workloads.py` (prompts
  whose output repeats the context, and novel ones), `spec_prompt_kv.py` (`--prompt-kv`: the
  draft's prompt KV computed on the decode worker vs sent by the prefill worker).
- `shared_prefix_bench.py` — per-step attention time of beams attending as shared-prefix
  families vs one table each, by shared blocks (`python -m pdserve.bench.shared_prefix_bench`).
- `op_profile.py` — torch.profiler self time per op as shares of a step's wall time, and the
  share outside weight matmuls (`bench engine --op-profile`).
- `step_phases.py` — a decode step's wall time by the engine's phases (`bench engine
  --step-phases`), without a profiler.
- `step_recorder.py` — records an engine's steps (work, seconds) and fits them into a
  `--sim-profile` file.
- `transfer_bench.py` — `bench transfer`: KV transfer GB/s vs raw TCP; `nixl_ceiling.py`
  (bare-NIXL READ and WRITE of the same bytes, the nixl transport's ceiling).
- `tracing_bench.py`, `span_receiver.py` — `bench tracing`: latency with tracing on vs off.
- `api_bench.py` — `bench api`: OpenAI HTTP vs gRPC streaming TTFT and ITL, one system.
- `soak_bench.py` — `bench soak`: does memory or anything held grow under sustained load?
- `control_plane_bench.py` — `bench control-plane`: the routing decision and the Redis index
  at 256 workers and 1M blocks; `control_plane_workload.py` (what the workers cache, the routed
  prompts), `control_plane_fill.py` (sim engines publish the index), `control_plane_routing.py`
  (times `Routing.choose`), `control_plane_churn.py` (KV events flowing while decisions are
  timed), `control_plane_events.py` (publishing load per worker).
- `fidelity_bench.py` — `bench fidelity`: sim workers with a profile calibrated on the CPU
  engine vs the real CPU system, same requests; `fidelity_calibration.py` records the steps
  and KV pushes of serving workers; `child_system.py` serves a second system from a child
  process on the same Ray cluster, so two can be measured interleaved.
- `sim_memory.py` — `bench sim-memory`: RSS of sim vs torch worker actors, and of 64 sim
  workers started together.
- `system_probe.py` — a served system's processes and leftovers (blocks, reservations).
"""
