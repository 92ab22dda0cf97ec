"""Benchmarks of the KV transports.

- `transfer_bench.py` — `bench transfer`: KV transfer GB/s vs raw TCP.
- `nixl_ceiling.py` — bare-NIXL READ and WRITE of the same bytes, the nixl transport's ceiling.
"""
