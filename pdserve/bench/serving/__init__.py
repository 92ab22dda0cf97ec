"""Benchmarks of a served system under load.

- `serve_bench.py` — `bench serve`: the harness against a running server.
- `openai_load.py` — the same load over any OpenAI-compatible server's streaming
  /v1/completions (`bench serve --backend openai`).
- `api_bench.py` — `bench api`: OpenAI HTTP vs gRPC streaming TTFT and ITL, one system.
- `compare_bench.py` — `bench compare`: disaggregated vs colocated on the same cores.
- `router_bench.py` — `bench router`: the cost policy vs round-robin.
- `tenants_bench.py` — `bench router-tenants`: issue 50's tenants workload, the six policies
  ranked on the real CPU system.
- `kv_tiers_bench.py` — `bench kv-tiers`: a chat over 4x the KV pool, host tier on vs off.
- `peer_pull_bench.py` — `bench peer-pull`: the chat on 2 workers, `--peer-pull` on vs off.
- `multi_turn_chat.py` — what those two share: the chat's arguments and requests, its
  minimum computed tokens, one way's run and stats, the ratios over the way without, the table
  and the --json report.
- `tracing_bench.py`, `span_receiver.py` — `bench tracing`: latency with tracing on vs off.
- `soak_bench.py` — `bench soak`: does memory or anything held grow under sustained load?
"""
