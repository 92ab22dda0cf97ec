"""The global prefix index in Redis: which worker holds which KV blocks, and reuse statistics.

- `schema.py` — key layout (block → workers, epochs, heartbeats, reuse counters, event stream).
- `publisher.py` — worker side: publishes KV events under the worker's epoch, heartbeats,
  resyncs after an outage; `feeder.py` moves the engine's events to it off the engine thread.
- `lookup.py` — router side: `PrefixIndex.lookup` (the router's copy, or one round trip), reuse
  recording; `mirror.py` — that copy of the index, built from Redis and fed by its event stream.
- `sweeper.py` — garbage collection of dead workers' and stale epochs' entries, bounded rounds;
  `maintenance.py` runs it in the router with a periodic ping (the `pdserve_redis_up` gauge).
- `reuse_stats.py` — hit/miss prompt tokens per worker and model (`pdserve stats`).
- `spec_stats.py` — speculative decoding's draft and accepted tokens per worker and model
  (`pdserve stats`).
- `redis_link.py` — a Redis client that notices outages and recovers.
- `redis_server.py` — the private `redis-server` that `pdserve serve` starts when no URL is given
  (random password, supervised); `local_servers.py` — the notes of its URL for `pdserve stats`.
"""
