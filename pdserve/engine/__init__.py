"""The serving engine, one noun per module (torch only behind its executor seam). Import from
the modules themselves.
Serving plumbing (Ray actors, the engine thread) lives in `pdserve.worker`; the plain request
types in `pdserve.core`. This package imports none of ray, grpc or redis.

- `engine.py` — `LLMEngine`: add_request / step / abort, and the disaggregation hooks; n
  choices and beam search as forked sequences.
- `executor.py` — the executor seam (`Executor`, `make_executor`): torch or sim, imported on
  use.
- `scheduler.py` — continuous batching, chunked prefill, preemption by recompute.
- `block_manager.py` — blocks, reference counts, prefix cache (LRU), KV events, forks with
  copy-on-write.
- `beam_search.py` — `BeamSearch`: one beam-search request's state, transformers' rule;
  `BeamRequest`: its running beams and their offers.
- `model_runner.py` — `TorchExecutor` (the torch side of the executor seam) and `ModelRunner`:
  the paged KV cache tensor; batch -> tensors -> logits.
- `sampler.py` — repetition penalty; greedy / temperature / top-k / top-p / seeded sampling,
  logprobs.
- `factuality.py` — DoLa and SLED: contrast the final layer's logits with earlier layers'.
- `premature_layers.py` — which earlier layers a DoLa/SLED request contrasts with (no torch).
- `sequence.py` — one request's state (`Sequence`, `SequenceStatus`).
- `outputs.py` — `RequestOutput`, `Reservation`: plain data (no torch).
"""
