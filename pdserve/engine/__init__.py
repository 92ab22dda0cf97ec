"""The serving engine (torch), one noun per module. Import from the modules themselves:
this package's import stays torch-free, so the router can use `sampling_params` cheaply.

- `engine.py` — `LLMEngine`: add_request / step / abort, and the disaggregation hooks.
- `scheduler.py` — continuous batching, chunked prefill, preemption by recompute.
- `block_manager.py` — blocks, reference counts, prefix cache (LRU), KV events.
- `model_runner.py` — the paged KV cache tensor; batch -> tensors -> logits.
- `sampler.py` — greedy / temperature / top-k / top-p / seeded sampling, logprobs.
- `sequence.py` — one request's state (`Sequence`, `SequenceStatus`).
- `sampling_params.py`, `outputs.py`, `kv_events.py` — plain data (no torch).
"""
