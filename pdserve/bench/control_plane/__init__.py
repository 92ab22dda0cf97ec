"""The control plane at scale: `bench control-plane`, the routing decision and the Redis
index at 256 workers and 1M blocks.

- `control_plane_bench.py` — the command: fill, time decisions, report.
- `control_plane_workload.py` — what the workers cache, the routed prompts.
- `control_plane_fill.py` — sim engines publish the index.
- `control_plane_routing.py` — times `Routing.choose`.
- `control_plane_churn.py` — KV events flowing while decisions are timed.
- `control_plane_events.py` — publishing load per worker.
"""
