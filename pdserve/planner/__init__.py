"""The offline planner (`pdserve plan`, docs/planner.md): how many prefill and decode workers,
or colocated, for a workload and TTFT/TPOT targets, found by simulating pdserve's own engines
and router on a virtual clock (no Ray, no sleeping).

- `events.py` — `EventLoop`: the virtual clock, a heap of timed callbacks.
- `workload.py` — presets and JSONL workloads; the sample of requests a probe offers.
- `deployment.py` — `Deployment`: model, GPU and engine settings; sim engines that never sleep.
- `virtual_worker.py` — `VirtualWorker`: one worker's engine stepping on the virtual clock.
- `virtual_request.py` — `VirtualRequest`: one request's route, handoff and tokens.
- `virtual_pull.py` — a local prefill's peer pull (--peer-pull) on the virtual clock.
- `cluster.py` — `VirtualCluster`: the workers behind the router's own `Routing`.
- `probe.py` — `run_probe`: one split at one rate, and whether enough requests met the SLOs.
- `closed_loop.py` — `run_closed_loop`: clients that wait for their answers (fixed concurrency).
- `virtual_index.py` — the router's copy of the prefix index on the virtual clock, KV events applied after a lag.
- `role_switching.py` — `VirtualRoleSwitcher`: `--role-switching`'s decision and drain on the virtual clock.
- `splits.py` — `all_splits`, `tp_splits`: the splits compared; the replicas one is simulated as.
- `capacity.py` — `worker_rates`, `split_estimate`: what a split could serve at best (timing model).
- `search.py` — `Search`: goodput of every split by bisection over the rate.
- `search_pool.py` — the processes `--jobs` searches in (started by a fork server, not forked).
- `ceiling.py` — `compute_ceiling`: the requests/s a sample's FLOPs allow on every GPU.
- `report.py` — the plan as a table and as JSON.
- `online.py` — one window of a live router's traffic and measured costs planned (child process).
"""
