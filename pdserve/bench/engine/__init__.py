"""Benchmarks of the engine alone.

- `engine_bench.py` — `bench engine`: decode tokens/s vs transformers; `--profile-out` fits a
  sim timing profile.
- `mixed_engine_bench.py` — `bench engine-mixed`: requests/s on ShareGPT-like mixed lengths,
  continuous batching vs transformers' `generate` in static batches.
- `disk_demotion_bench.py` — `bench disk-demotion`: the engine thread's time per block demoted
  from the host tier to the disk tier, the file written there vs queued to the writer thread.
- `expert_parallel_bench.py` — `bench moe-tp`: an MoE model on TP ranks, its experts run on
  every token and all-reduced vs `--expert-parallel`'s all_to_all dispatch.
- `tp_decode_bench.py` — `bench tp-decode`: decode tokens/s at TP N (the served worker's
  executors over spawned Gloo ranks) vs TP 1, rank 0's broadcast time, a handoff's bytes.
- `op_profile.py` — torch.profiler self time per op as shares of a step's wall time, and the
  share outside weight matmuls (`bench engine --op-profile`).
- `step_phases.py` — a decode step's wall time by the engine's phases (`bench engine
  --step-phases`), without a profiler.
- `step_recorder.py` — records an engine's steps (work, seconds) and fits them into a
  `--sim-profile` file.
"""
