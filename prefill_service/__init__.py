"""The prefill worker: an engine in the prefill role plus the KV sender.

- `worker.py` — `PrefillWorker` (Ray actor): computes a prompt, pushes the blocks the decode
  worker lacks, commits with the first token, releases the blocks to its prefix cache.
"""
