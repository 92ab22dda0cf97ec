"""The step machinery between the scheduler's batch and the model: a step's inputs as tensors,
decode steps as compiled graphs (CUDA graphs on a GPU), steps overlapped with the host's work,
the KV pool sized on a GPU. The rules of decoding are in `pdserve.engine.decoding`; these
modules only make a step cheap. Import from the modules themselves.

- `host_tensors.py` — a step's int64 inputs as CPU tensors, without torch.tensor's
  per-element conversion.
- `attention_batch.py` — a step's `AttentionContext` (built once, used by every layer), with
  its sequences in attention groups when their lengths differ widely.
- `compiled_decode.py` — `CompiledDecode`: decode-only steps as compiled static-shape graphs
  (`--compile`; CUDA graphs on CUDA), batch and block tables padded to buckets.
- `cuda_graphs.py` — `CudaGraphs`: the compiled decode step's CUDA graphs, captured by hand and
  replayed after one copy of the step's inputs.
- `overlapped_steps.py` — `OverlappedSteps`, the engine's async scheduling: plain greedy
  decode steps launched before the previous step's tokens are back, landing a step later (no
  torch).
- `memory_profile.py` — the KV pool on CUDA from `--gpu-memory-utilization`: a profiled step.
"""
