"""`pdserve bench KIND`: every benchmark prints ratios against a baseline measured in the same run.

Each benchmark module exposes `add_arguments(parser)` and `run(args) -> int`, like a command.
"""

from __future__ import annotations

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "engine": ("pdserve.bench.engine_bench", "decode tokens/s of the engine vs transformers"),
    "transfer": ("pdserve.bench.transfer_bench", "KV transfer GB/s vs raw TCP on loopback"),
    "serve": ("pdserve.bench.serve_bench", "load generator against a running server"),
    "compare": ("pdserve.bench.compare_bench", "disaggregated vs colocated under mixed load"),
    "router": ("pdserve.bench.router_bench", "routing policy vs round-robin"),
    "tracing": ("pdserve.bench.tracing_bench", "request latency with tracing on vs off"),
    "api": ("pdserve.bench.api_bench", "OpenAI HTTP vs gRPC streaming latency"),
    "soak": ("pdserve.bench.soak_bench", "RSS per process and leftovers under long mixed load"),
}
