"""What a load is made of and what is measured of each request: shared by the benchmarks
(pdserve/bench) and the offline planner (pdserve/planner), which predicts the same figures
for the same requests. A package of its own so that the planner never imports pdserve.bench
(which imports the planner to validate it).

- `datasets.py` — workloads: random, shared-prefix, mixed, chat, sharegpt:FILE (pure
  functions of their settings and seed).
- `metrics.py` — per-request TTFT/TPOT/ITL/E2E, summaries, SLO goodput (DistServe's
  definition).
"""
