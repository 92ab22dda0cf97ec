"""`pdserve bench plan-validate` (issue 20 point 2): the offline planner's prediction against a
live cluster of sim workers serving the same requests. A package of its own, not part of
`pdserve.bench`: it imports the planner, which imports the benchmarks' metrics and workloads
(import cycles between sibling packages are refused by the import-linter contract).

- `bench.py` — the command: offline search and probes, the live sweep, the comparison.
- `report.py` — the planned and live figures of a scenario, their ratios and the table.
"""
