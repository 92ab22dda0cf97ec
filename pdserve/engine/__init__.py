"""The serving engine, one noun per module (torch only behind its executor seam). Import from
the modules themselves.
Serving plumbing (Ray actors, the engine thread) lives in `pdserve.worker`; the plain request
types in `pdserve.core`. This package imports none of ray, grpc or redis.

- `engine.py` — `LLMEngine`: add_request / step / abort, and the disaggregation hooks.
- `forked_choices.py` — `ForkedChoices`, the engine's steps for n choices and beam search as
  forked sequences sharing KV blocks.
- `step_outputs.py` — `StepOutputs`, the engine's steps from a step's sampled tokens to
  sequences' tokens and `RequestOutput`s (the per-token path, with a short path for the usual
  token).
- `overlapped_steps.py` — `OverlappedSteps`, the engine's async scheduling: plain greedy
  decode steps launched before the previous step's tokens are back, landing a step later.
- `executor.py` — the executor seam (`Executor`, `make_executor`): torch or sim, imported on
  use.
- `scheduler.py` — continuous batching, chunked prefill, preemption by recompute.
- `block_manager.py` — blocks, reference counts, prefix cache (LRU), KV events, forks with
  copy-on-write.
- `beam_search.py` — `BeamSearch`: one beam-search request's state, transformers' rule;
  `BeamRequest`: its running beams and their offers.
- `model_runner.py` — `TorchExecutor` (the torch side of the executor seam) and `ModelRunner`:
  the paged KV cache tensor; batch -> tensors -> logits.
- `tp_executor.py` — a tensor-parallel worker's executors: rank 0's `LeaderExecutor` broadcasts
  each step, block copy and KV read/write; the other ranks `follow`.
- `attention_batch.py` — a step's `AttentionContext` (built once, used by every layer), with
  its sequences in attention groups when their lengths differ widely.
- `compiled_decode.py` — `CompiledDecode`: decode-only steps as compiled static-shape graphs
  (`--compile`; CUDA graphs on CUDA), batch and block tables padded to buckets.
- `grammar.py` — `Grammars`: structured output with xgrammar (compiled grammars cached per
  spec, a matcher per sequence, the token mask applied before sampling).
- `cuda_graphs.py` — `CudaGraphs`: the compiled decode step's CUDA graphs, captured by hand and
  replayed after one copy of the step's inputs.
- `host_tensors.py` — a step's int64 inputs as CPU tensors, without torch.tensor's per-element
  conversion.
- `memory_profile.py` — the KV pool on CUDA from `--gpu-memory-utilization`: a profiled step.
- `sampler.py` — repetition penalty; greedy / temperature / top-k / top-p / seeded sampling,
  logprobs.
- `factuality.py` — DoLa and SLED: contrast the final layer's logits with earlier layers'.
- `premature_layers.py` — which earlier layers a DoLa/SLED request contrasts with (no torch).
- `sequence.py` — one request's state (`Sequence`, `SequenceStatus`).
- `speculative.py` — speculative decoding's proposers: the `Proposer` contract,
  `NgramProposer` (prompt lookup), `make_proposer`.
- `draft_proposer.py` — `DraftProposer`: a draft model's proposals, its paged KV cache under the
  target's block ids (torch).
- `speculation.py` — the engine's side of speculative decoding: drafts in and out of the
  batch, rollback of rejected ones, counters, the self switch-off (no torch).
- `spec_verify.py` — verification of drafts: greedy acceptance and rejection sampling.
- `spec_payoff.py` — `StepTimes`: decode steps timed with and without drafts, whether
  speculation pays (no torch).
- `outputs.py` — `RequestOutput`, `Reservation`: plain data (no torch).
"""
