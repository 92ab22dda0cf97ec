"""The decode worker: an engine in the decode role plus the KV receiver.

- `worker.py` — `DecodeWorker` (Ray actor): reserves blocks, receives KV (`KVSink`), decodes and
  streams `TokenBatch`es; prefills locally when routed so.
- `peer_pull_methods.py` — DecodeWorker's peer pull methods (`reserve_pull`, `push_prefix`,
  `fall_back`), a mixin kept apart from the handoff path.
- `prefix_push.py` — the holder's side of a peer pull: pins its cached prefix and pushes it into
  the puller's reservation with the KV sender; refuses a prefix it no longer holds whole.
- `handoffs.py` — the in-flight handoffs: one record per reserved request until it is
  committed, aborted or expired.
"""
