"""Benchmarks (`pdserve bench ...`); each prints ratios against a baseline run in the same run.

One subpackage per thing measured, as `pdserve bench --help` groups the subcommands
(pdserve/commands/bench.py) and BENCHMARKS.md its tables; each subpackage's docstring lists its
modules. The workloads and per-request metrics are pdserve/workloads, shared with the planner.

- `common/` — what several groups share: load over the gRPC API, a served system on this
  machine, its processes and leftovers, tables and plots.
- `engine/` — the engine alone: decode speed vs transformers, mixed lengths, where a step goes.
- `decoding/` — speculative decoding, and beam search's shared-prefix attention.
- `transfer/` — the KV transports against raw TCP and bare NIXL.
- `serving/` — a served system under load: `bench serve`, `api`, `compare`, `router`,
  `tracing`, `soak`.
- `control_plane/` — the routing decision and the Redis index at 256 workers.
- `simulation/` — sim workers: P:D splits, routing policies, memory, fidelity to the real system.
- `planner_validation/` — the planner's virtual cluster against live sim workers.

Import direction: `planner_validation` → `simulation` → `common`, `engine`; nothing that serves
imports this package (an import-linter contract in pyproject.toml).
"""
