"""Simulated GPU workers: pdserve's own scheduler, block manager, prefix cache and transfer
protocol, with the model forward replaced by a timing model (docs/simulation.md).

This package imports nothing of pdserve (and never torch), so the config can check a profile
and a sim worker process stays free of torch.

- `gpus.py` — `GPUSpec` and the spec-sheet table (H100 SXM, H200, A100 80GB, L40S).
- `model_shape.py` — `ModelShape`: parameter, FLOP and byte counts from an HF config.json.
- `timing.py` — `StepWork` (what one engine step computes) and the step-time models.
- `profiles.py` — `--sim-profile` values (`analytical:GPU[:tpN]` or a JSON file) to models.
- `shapes.py` — config.json of Llama-3.1-8B/70B shapes, for config-only model directories.
- `tokens.py` — `sim_token`: the deterministic next token of a context.
- `fit.py` — `fit_linear`: a linear profile fitted to measured engine steps.
- `kv.py` — `SimKVCache` and `SimulatedKV`: the KV cache's shape without its bytes.
- `kv_tiers.py` — the host and disk tiers' links: transfers charged to steps, no bytes.
- `executor.py` — `SimExecutor`: the engine's executor seam, timed by a profile.
"""
