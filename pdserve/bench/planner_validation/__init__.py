"""Benchmarks that run the offline planner's virtual cluster: `pdserve bench plan-validate`
(issue 20 point 2), the planner's prediction against a live cluster of sim workers serving the
same requests, and `pdserve bench sim-routing-offline`. The planner imports the request
vocabulary of pdserve/workloads, never pdserve.bench, so this package may import the planner
without an import cycle.

- `plan_validate_bench.py` — the command: offline search and probes, the live sweep, the
  comparison.
- `report.py` — the planned and live figures of a scenario, their ratios and the table.
- `rates.py` — the swept rates, extended until the offline sweep brackets the goodput.
- `ttft_parts.py` — where each request's TTFT went, offline and live, compared by index.
- `routing_offline.py` — `bench sim-routing`'s policies and workloads on the virtual cluster.
- `kv_tiers_offline.py` — `bench sim-kv-tiers`: `bench kv-tiers`' chat on 16 virtual H100s,
  without tiers vs host (PCIe 5) and disk (NVMe) tiers, rates swept.
- `routing_tenants.py` — the multi-tenant workload: six policies per rate (or per concurrency, closed loop) on the virtual cluster.
"""
