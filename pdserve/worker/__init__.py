"""What the prefill and decode Ray actors share (their roles live in prefill_service/ and
decode_service/).

- `worker_actor.py` — `WorkerActor`: the actor skeleton (lazy start, `ready`, `stats`).
- `worker_runtime.py` — `WorkerRuntime`: engine + loop, step costs, stats, KV events to the index.
- `engine_loop.py` — `EngineLoop`: the engine on its own thread, outputs to asyncio queues.
- `aborted_requests.py` — `AbortedRequests`: aborts remembered for calls Ray runs after them.
- `switchable_worker.py` — `SwitchableWorker`: both roles on one engine, `set_role` moves it
  between them (`--role-switching`).
- `memory_usage.py` — peak RSS and peak CUDA memory of the worker process (WorkerStats).
- `worker_spec.py` — `WorkerSpec`: everything an actor is started with (no secrets in env).
- `worker_spec.py` — `WorkerSpec`: all one actor is started with (its constructor argument).
- `pools.py` — `create_workers`: the actors on their Ray pools (custom resources, GPUs); a
  STRICT_PACK placement group per tensor-parallel worker.
- `tp_placement.py` — start-up checks of each pool's TP: the model splits that way, a node
  holds a whole worker.
- `rank_group.py` — `RankGroup`, `RankActor`: a tensor-parallel worker's rank actors, their
  torch.distributed group, and the watch that takes the worker down as a unit.
- `rank_kv.py` — `RankKV`: rank r > 0's own KV transport, for its heads of each handoff.
"""
