"""The serving engine, one noun per module (torch only behind its executor seam). Import from
the modules themselves.
Serving plumbing (Ray actors, the engine thread) lives in `pdserve.worker`; the plain request
types in `pdserve.core`. This package imports none of ray, grpc or redis.

- `engine.py` — `LLMEngine`: add_request / step / abort, and the disaggregation hooks.
- `scheduler.py` — continuous batching, chunked prefill, preemption by recompute.
- `block_manager.py` — blocks, reference counts, prefix cache (LRU), KV events.
- `model_runner.py` — `TorchExecutor` (the torch side of the executor seam) and `ModelRunner`:
  the paged KV cache tensor; batch -> tensors -> logits.
- `sampler.py` — greedy / temperature / top-k / top-p / seeded sampling, logprobs.
- `sequence.py` — one request's state (`Sequence`, `SequenceStatus`).
- `outputs.py` — `RequestOutput`, `Reservation`: plain data (no torch).
"""
