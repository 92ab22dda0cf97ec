"""Benchmarks on sim workers.

- `sim_run.py` — a served system of sim workers: workloads at simulated rates, figures in
  simulated time.
- `sim_saturation.py` — the saturation check that refuses a sim run's figures when the CPU,
  not the timing model, set the pace.
- `sim_disagg_bench.py` — `bench sim-disagg`: every P:D split vs colocated on 8 sim H100s,
  goodput at TTFT/TPOT SLOs.
- `sim_routing_bench.py` — `bench sim-routing`: routing policies on 16 and 64 sim workers,
  multi-turn chat.
- `sim_memory.py` — `bench sim-memory`: RSS of sim vs torch worker actors, and of 64 sim
  workers started together.
- `fidelity_bench.py` — `bench fidelity`: sim workers with a profile calibrated on the CPU
  engine vs the real CPU system, same requests.
- `layout_ranking.py` — `bench layout-ranking`: 1P+1D against 2 colocated workers on suite
  workloads scaled to a CPU, real and simulated with a profile fitted in the same run: do both
  rank the layouts alike?
- `layout_ranking_sim.py` — its simulated side: the layouts on the virtual cluster, a
  simulated goodput sweep.
- `layout_ranking_report.py` — its table.
- `worker_fidelity.py` — `bench fidelity-worker`: one real worker's engine (CPU or GPU) vs a
  sim worker with the profile fitted on it, without Ray (runs where only torch is installed).
- `worker_serving.py` — one worker's engine served in-process behind `EngineLoop` (the
  real and sim workers of `bench fidelity-worker`).
- `fidelity_calibration.py` — records the steps and KV pushes of serving workers.
- `fidelity_eval.py` — the evaluation workloads (not the calibration's) and the real runs'
  bands the sim is judged against.
- `disagg_suite/` — `bench sim-disagg --suite`: every layout, `auto` and the field's rules
  over workloads, models and SLOs on the planner's virtual cluster.
- `role_switch_bench.py` — `bench sim-role-switching`: `--role-switching` on the
  phase-shifting trace vs every static layout, on the planner's virtual cluster.
- `child_system.py` — serves a second system from a child process on the same Ray cluster,
  so two can be measured interleaved.
"""
