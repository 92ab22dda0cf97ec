"""`pdserve bench KIND`: every benchmark prints ratios against a baseline measured in the same run.

Each benchmark module exposes `add_arguments(parser)` and `run(args) -> int`, like a command.
"""

from __future__ import annotations

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "engine": ("pdserve.bench.engine_bench", "decode tokens/s of the engine vs transformers"),
    "engine-mixed": (
        "pdserve.bench.mixed_engine_bench",
        "requests/s on mixed lengths: continuous batching vs transformers' static batches",
    ),
    "transfer": ("pdserve.bench.transfer_bench", "KV transfer GB/s vs raw TCP on loopback"),
    "serve": ("pdserve.bench.serve_bench", "load generator against a running server"),
    "compare": ("pdserve.bench.compare_bench", "disaggregated vs colocated under mixed load"),
    "router": ("pdserve.bench.router_bench", "routing policy vs round-robin"),
    "tracing": ("pdserve.bench.tracing_bench", "request latency with tracing on vs off"),
    "api": ("pdserve.bench.api_bench", "OpenAI HTTP vs gRPC streaming latency"),
    "soak": ("pdserve.bench.soak_bench", "RSS per process and leftovers under long mixed load"),
    "control-plane": (
        "pdserve.bench.control_plane_bench",
        "routing decision latency and Redis index load at 256 workers",
    ),
    "fidelity": ("pdserve.bench.fidelity_bench", "sim workers vs the real CPU system they model"),
    "sim-memory": ("pdserve.bench.sim_memory", "RSS of sim vs torch workers; 64 sim workers"),
    "sim-disagg": ("pdserve.bench.sim_disagg_bench", "every P:D split vs colocated on 8 sim H100s"),
    "sim-routing": ("pdserve.bench.sim_routing_bench", "routing policies on 16 and 64 sim workers"),
    "sim-routing-offline": (
        "pdserve.plan_validation.routing_offline",
        "the same on the planner's virtual cluster: no Ray, any size in seconds",
    ),
    "plan-validate": ("pdserve.plan_validation.bench", "planner vs live sim cluster"),
    "spec": ("pdserve.bench.spec_bench", "decode tok/s with speculative decoding (ngram, draft)"),
}
