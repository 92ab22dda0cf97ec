"""`pdserve bench KIND`: every benchmark prints ratios against a baseline measured in the same run.

Each benchmark module exposes `add_arguments(parser)` and `run(args) -> int`, like a command.
The subcommands are grouped by what they measure, as pdserve/bench/ is, and `pdserve bench
--help` lists them by group; BENCHMARKS.md has one table per group.
"""

from __future__ import annotations

# group -> name -> (module, one-line help)
GROUPS: dict[str, dict[str, tuple[str, str]]] = {
    "engine": {
        "engine": (
            "pdserve.bench.engine.engine_bench",
            "decode tokens/s of the engine vs transformers",
        ),
        "engine-mixed": (
            "pdserve.bench.engine.mixed_engine_bench",
            "requests/s on mixed lengths: continuous batching vs transformers' static batches",
        ),
        "disk-demotion": (
            "pdserve.bench.engine.disk_demotion_bench",
            "engine-thread time per host-to-disk KV demotion: file written there vs queued",
        ),
        "moe-tp": (
            "pdserve.bench.engine.expert_parallel_bench",
            "an MoE model on TP ranks: experts all-reduced vs --expert-parallel's all_to_all",
        ),
        "tp-decode": (
            "pdserve.bench.engine.tp_decode_bench",
            "decode tokens/s of one worker on TP ranks vs TP 1 (one thread, and as many)",
        ),
    },
    "decoding": {
        "spec": (
            "pdserve.bench.decoding.spec_bench",
            "decode tok/s with speculative decoding (ngram, draft)",
        ),
        "sampler": (
            "pdserve.bench.decoding.sampler_bench",
            "the host's sampling step at a 128k vocabulary: seeded vs unseeded, fused vs torch",
        ),
    },
    "transfer": {
        "transfer": (
            "pdserve.bench.transfer.transfer_bench",
            "KV transfer GB/s vs raw TCP on loopback",
        ),
        "tp-handoff": (
            "pdserve.bench.transfer.tp_handoff_bench",
            "a tensor-parallel KV handoff per (P TP, D TP): bytes, descriptors, s vs grpc",
        ),
    },
    "serving": {
        "serve": ("pdserve.bench.serving.serve_bench", "load generator against a running server"),
        "compare": (
            "pdserve.bench.serving.compare_bench",
            "disaggregated vs colocated under mixed load",
        ),
        "router": ("pdserve.bench.serving.router_bench", "routing policy vs round-robin"),
        "router-tenants": (
            "pdserve.bench.serving.tenants_bench",
            "the six routing policies on issue 50's tenants workload, scaled to this machine",
        ),
        "kv-tiers": (
            "pdserve.bench.serving.kv_tiers_bench",
            "multi-turn chat over 4x the KV pool: the host tier on vs off",
        ),
        "peer-pull": (
            "pdserve.bench.serving.peer_pull_bench",
            "multi-turn chat on 2 workers, turns on either: --peer-pull on vs off",
        ),
        "tracing": (
            "pdserve.bench.serving.tracing_bench",
            "request latency with tracing on vs off",
        ),
        "api": ("pdserve.bench.serving.api_bench", "OpenAI HTTP vs gRPC streaming latency"),
        "soak": (
            "pdserve.bench.serving.soak_bench",
            "RSS per process and leftovers under long mixed load",
        ),
    },
    "control plane": {
        "control-plane": (
            "pdserve.bench.control_plane.control_plane_bench",
            "routing decision latency and Redis index load at 256 workers",
        ),
    },
    "simulation": {
        "fidelity": (
            "pdserve.bench.simulation.fidelity_bench",
            "sim workers vs the real CPU system they model",
        ),
        "fidelity-worker": (
            "pdserve.bench.simulation.worker_fidelity",
            "one real worker (CPU or GPU) vs a sim worker with the profile fitted on it",
        ),
        "layout-ranking": (
            "pdserve.bench.simulation.layout_ranking",
            "1P+1D vs 2 colocated on the real CPU system and in the simulation: same ranking?",
        ),
        "sim-memory": (
            "pdserve.bench.simulation.sim_memory",
            "RSS of sim vs torch workers; 64 sim workers",
        ),
        "sim-disagg": (
            "pdserve.bench.simulation.sim_disagg_bench",
            "every P:D split vs colocated on 8 sim H100s",
        ),
        "sim-role-switching": (
            "pdserve.bench.simulation.role_switch_bench",
            "--role-switching on the phase-shifting trace vs every static layout (offline)",
        ),
        "sim-routing": (
            "pdserve.bench.simulation.sim_routing_bench",
            "routing policies on 16 and 64 sim workers",
        ),
    },
    "planner validation": {
        "sim-routing-offline": (
            "pdserve.bench.planner_validation.routing_offline",
            "the same on the planner's virtual cluster: no Ray, any size in seconds",
        ),
        "sim-kv-tiers": (
            "pdserve.bench.planner_validation.kv_tiers_offline",
            "kv-tiers' chat on 16 virtual H100s: host (PCIe 5) and disk (NVMe) tiers vs none",
        ),
        "plan-validate": (
            "pdserve.bench.planner_validation.plan_validate_bench",
            "planner vs live sim cluster",
        ),
    },
}

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    name: entry for group in GROUPS.values() for name, entry in group.items()
}
