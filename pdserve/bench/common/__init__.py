"""What several benchmark groups share.

- `load_generator.py` — open-loop (gamma arrivals) or closed-loop load over the gRPC API,
  recording client-side timestamps.
- `local_system.py` — model, mixed workload, local Ray, a served system on this machine with
  pinned workers.
- `system_probe.py` — a served system's processes and leftovers (blocks, reservations).
- `spawned_ranks.py` — a Gloo group of spawned processes, one per tensor-parallel rank (no
  Ray), that runs a function on every rank.
- `report.py`, `plots.py` — rich tables, JSON, latency CDF plots.
"""
