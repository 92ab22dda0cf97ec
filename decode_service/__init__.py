"""The decode worker: an engine in the decode role plus the KV receiver.

- `worker.py` — `DecodeWorker` (Ray actor): reserves blocks, receives KV (`KVSink`), decodes and
  streams `TokenBatch`es; prefills locally when routed so.
- `handoffs.py` — the in-flight handoffs: one record per reserved request until it is
  committed, aborted or expired.
"""
