"""Benchmarks of the KV transports.

- `transfer_bench.py` — `bench transfer`: KV transfer GB/s vs raw TCP.
- `nixl_ceiling.py` — bare-NIXL READ and WRITE of the same bytes, the nixl transport's ceiling.
- `tp_handoff_bench.py` — `bench tp-handoff`: one tensor-parallel KV handoff per (P TP, D TP)
  pair, each transport against grpc: bytes per prefill rank, descriptors, seconds.
- `tp_ranks.py` — a TP prefill worker's senders and a TP decode worker's receivers in one
  process over the shipped handoff path (also the handoff tests' harness).
"""
