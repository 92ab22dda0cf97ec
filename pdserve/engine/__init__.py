"""The serving engine, one noun per module (torch only behind its executor seam). Import from
the modules themselves.
Serving plumbing (Ray actors, the engine thread) lives in `pdserve.worker`; the plain request
types in `pdserve.core`. This package imports none of ray, grpc or redis.

- `engine.py` — `LLMEngine`: add_request / step / abort, and the disaggregation hooks (each
  delegated to its part below).
- `kv_handoff.py` — `KVHandoff`, the decode side of a KV handoff: a prompt's block table
  reserved for KV written from elsewhere, then committed with its first token.
- `engine_stats.py` — what `LLMEngine.stats()` reports, gathered from the engine's parts.
- `host_tier_config.py` — the host (and disk) tier an engine's config asks for, made for its
  executor (torch, tensor-parallel, sim).
- `request_admission.py` — `RequestAdmission`: a request checked and made its first `Sequence`;
  each sequence's detokenizer.
- `step_outputs.py` — `StepOutputs`, the engine's steps from a step's sampled tokens to
  sequences' tokens and `RequestOutput`s (the per-token path, with a short path for the usual
  token).
- `executor.py` — the executor seam (`Executor`, `make_executor`): torch or sim, imported on
  use.
- `scheduler.py` — continuous batching, chunked prefill, preemption by recompute.
- `block_manager.py` — blocks, reference counts, prefix cache (LRU), KV events, forks with
  copy-on-write.
- `host_tier.py` — `HostTier`: the prefix-cache blocks the device pool evicted, kept in host
  memory (`--kv-offload-gb`): LRU, prefix-closed with the device cache, a fixed slot budget;
  what it evicts goes to the disk tier below it when there is one (no torch).
- `host_kv_pool.py` — `HostKVPool`: the host tier's bytes (pinned, side-stream copies on CUDA),
  `make_host_tier` (with its disk tier).
- `disk_tier.py` — `DiskTier`: the blocks the host tier evicted, in files (`--kv-disk-dir`,
  `--kv-disk-gb`): read back to the device through a host staging buffer; a bad file is a miss.
- `disk_block_files.py` — `DiskBlockFiles`: one file per block, written atomically and
  checksummed; a directory per run, dead runs' deleted at start.
- `disk_block_writer.py` — `BlockFileWriter`: the disk tier's writes on a thread of their own,
  from a bounded queue of block copies that also serves reads of blocks still queued.
- `sim_host_tier.py` — the host and disk tiers of a sim engine: the same classes over byte
  movers that hold nothing and charge modelled link time (pdserve/sim/kv_tiers.py).
- `tier_index.py` — `TierIndex`: which blocks a tier below the device holds, LRU, with subtree
  eviction (shared by the host and disk tiers).
- `model_runner.py` — `TorchExecutor` (the torch side of the executor seam) and `ModelRunner`:
  the paged KV cache tensor; batch -> tensors -> logits.
- `tp_executor.py` — a tensor-parallel worker's executors: rank 0's `LeaderExecutor` broadcasts
  each step, block copy and host-tier copy (`host_tier`: every rank moves its heads); the
  other ranks `follow`.
- `peer_prefixes.py` — `PeerPrefixes`, the engine's sides of a peer pull: the holder pins a
  cached prefix for its push; the puller commits pulled blocks as a prefix or falls back.
- `sequence.py` — one request's state (`Sequence`, `SequenceStatus`).
- `outputs.py` — `RequestOutput`, `Reservation`: plain data (no torch).

Subpackages: `decoding/` (the sampler, beam search, n choices, DoLa/SLED), `speculation/`
(proposers, verification, whether it pays), `gpu_step/` (step tensors, compiled decode and
CUDA graphs, overlapped steps, the GPU KV pool).
"""
