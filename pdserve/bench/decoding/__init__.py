"""Benchmarks of decoding rules.

- `spec_bench.py` — `bench spec`: decode tokens/s without speculation, with ngram and with a
  draft model, acceptance, cost ratio and the analytical limit.
- `spec_workloads.py` — prompts whose output repeats the context, and novel ones.
- `spec_prompt_kv.py` — `--prompt-kv`: the draft's prompt KV computed on the decode worker vs
  sent by the prefill worker.
- `shared_prefix_bench.py` — per-step attention time of beams attending as shared-prefix
  families vs one table each, by shared blocks (`python -m
  pdserve.bench.decoding.shared_prefix_bench`).
- `sampler_bench.py` — `bench sampler`: a sampling step's draw at a large vocabulary, seeded
  (fused and torch paths) against unseeded rows, tokens checked equal.
"""
