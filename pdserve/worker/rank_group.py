"""The rank actors of a tensor-parallel worker (engine.tp > 1) and their process group.

Rank 0 is the worker actor the router sees (scheduler, block manager, prefix cache, KV events:
all on rank 0). Every rank moves its own heads of a KV handoff (pdserve/worker/rank_kv.py):
rank 0 reaches the others' KV transport through Ray calls to their actors (threaded, so they
answer while `serve` runs the follow loop). When it starts it creates ranks 1..N-1 as `RankActor`s
in bundles 1..N-1 of its STRICT_PACK placement group (pools.py), so all ranks share its node;
it hosts the group's rendezvous (a TCPStore on 127.0.0.1 at a port the OS picks) and every rank
joins one torch.distributed group over it: Gloo on CPU, NCCL on CUDA. Rank 0 then runs the
engine on a LeaderExecutor and the others `follow` it (pdserve/engine/tp_executor.py).

The ranks are one unit: rank 0 owns the others (Ray ends an actor's children with it), a
follower whose group breaks (rank 0 gone: its collective raises) ends its own process, and
rank 0 ends its process when a follower's `serve` ends, so Ray restarts the whole worker with a
new epoch and the router's failover moves its requests.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import torch.distributed as dist
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kv_transfer.base import KVTransferError, TransferResult
from kv_transfer.tp_handoff import SlicedSend
from pdserve.engine.model_runner import TorchExecutor
from pdserve.engine.tp_executor import LeaderExecutor, follow
from pdserve.models.tensor_parallel import TensorParallel
from pdserve.worker.rank_kv import RankKV
from pdserve.worker.worker_spec import WorkerSpec

log = logging.getLogger(__name__)

# Followers wait in a broadcast for rank 0's next command however long the worker is idle, so
# the group's collectives must not time out; a rank that dies closes its connections, which
# fails the others' collectives at once.
IDLE_FOREVER = datetime.timedelta(days=365)
RENDEZVOUS_HOST = "127.0.0.1"  # STRICT_PACK: every rank is on rank 0's node
# Threads of a rank actor: `serve` holds one for the worker's life; rank 0's KV calls (opens,
# seals, aborts of concurrent handoffs, pushes) take the others.
RANK_ACTOR_THREADS = 16


def _join(spec: WorkerSpec, store: dist.Store, rank: int) -> TensorParallel:
    size = spec.engine.tp
    backend = "nccl" if spec.engine.device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=IDLE_FOREVER)
    # On CUDA each rank actor sees only the GPU(s) Ray gave it (--gpus-per-worker per rank).
    return TensorParallel(
        rank, size, own_device=backend == "nccl", expert_parallel=spec.engine.expert_parallel
    )


def _executor(spec: WorkerSpec, tp: TensorParallel) -> TorchExecutor:
    if spec.cpu_affinity:
        os.sched_setaffinity(0, spec.cpu_affinity)
    return TorchExecutor(spec.engine, Path(spec.engine.model), tp)


class RankActor:
    """Rank r > 0 of a TP worker: its shard of the model and of the KV cache, and its own KV
    transport for its heads."""

    def __init__(self) -> None:
        self._kv: RankKV | None = None
        self._kv_ready = threading.Event()

    def serve(self, spec: WorkerSpec, role: str, rank: int, port: int) -> None:
        """Joins the group, loads this rank's shard, starts its KV transport and replays rank
        0's commands until told to stop. A broken group ends this process: its worker restarts
        as a whole."""
        store = dist.TCPStore(RENDEZVOUS_HOST, port, spec.engine.tp, is_master=False)
        tp = _join(spec, store, rank)
        try:
            executor = _executor(spec, tp)
            self._kv = RankKV(role, spec.kv, executor, tp)
            self._kv_ready.set()
            follow(executor, tp)
        except Exception:
            log.exception("tensor-parallel rank %d lost its group; exiting", rank)
            os._exit(1)
        dist.destroy_process_group()

    def kv_endpoint(self) -> str:
        """This decode rank's KV endpoint, once its transport started."""
        self._kv_ready.wait()
        return self._kv.endpoint

    def kv_call(self, method: str, *args: Any) -> Any:
        return self._kv.call(method, *args)

    def push_heads(self, send: SlicedSend) -> TransferResult:
        return self._kv.push(send)


class RankGroup:
    """Rank 0's side: starts the followers, joins the group, watches them, and reaches their
    KV transports (`kv_endpoints`, `call_followers`, `start_pushes`)."""

    def __init__(self, worker_id: str, role: str, spec: WorkerSpec) -> None:
        size = spec.engine.tp
        # A KV call waits at most for a handoff's deadline (a seal waits for chunks in flight).
        self._kv_timeout_s = spec.kv.reservation_timeout_s + 5.0
        store = dist.TCPStore(RENDEZVOUS_HOST, 0, size, is_master=True, wait_for_workers=False)
        actor_cls = ray.remote(RankActor)
        self.followers = [
            actor_cls.options(
                name=f"pdserve-{worker_id}-rank{rank}-{os.getpid()}",
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    spec.placement_group, placement_group_bundle_index=rank
                ),
                max_restarts=0,
                max_concurrency=RANK_ACTOR_THREADS,
                **spec.rank_options,
            ).remote()
            for rank in range(1, size)
        ]
        self._served = [
            f.serve.remote(spec, role, rank, store.port) for rank, f in enumerate(self.followers, 1)
        ]
        self.tp = _join(spec, store, 0)
        self.executor = LeaderExecutor(_executor(spec, self.tp), self.tp)
        self._stopping = False
        threading.Thread(target=self._watch, name="tp-rank-watch", daemon=True).start()

    def kv_endpoints(self) -> list[str]:
        """Ranks 1..N-1's KV endpoints (a decode worker), in rank order."""
        return ray.get([f.kv_endpoint.remote() for f in self.followers])

    def call_followers(self, method: str, *args: Any) -> list[Any]:
        """`method` of ranks 1..N-1's receivers (tp_handoff.FollowerCalls); raises the first
        error as RuntimeError naming the rank (e.g. a seal that found a part missing)."""
        calls = [f.kv_call.remote(method, *args) for f in self.followers]
        answers = []
        for rank, call in enumerate(calls, 1):
            try:
                answers.append(ray.get(call, timeout=self._kv_timeout_s))
            except Exception as exc:
                raise RuntimeError(f"rank {rank}: {_reason(exc)}") from None
        return answers

    def start_pushes(self, send: SlicedSend) -> Callable[[], list[TransferResult]]:
        """Starts ranks 1..N-1's pushes of their heads; returns what waits for them (raising
        KVTransferError when one failed)."""
        pushes = [f.push_heads.remote(send) for f in self.followers]

        def wait() -> list[TransferResult]:
            results = []
            for rank, push in enumerate(pushes, 1):
                try:
                    results.append(ray.get(push, timeout=self._kv_timeout_s))
                except Exception as exc:
                    raise KVTransferError(f"prefill rank {rank}: {_reason(exc)}") from None
            return results

        return wait

    def _watch(self) -> None:
        """A follower whose serve() ended (its process died, or its group broke) takes this
        worker down as a unit: exit, and Ray restarts it with a new epoch."""
        ended, _ = ray.wait(self._served, num_returns=1, timeout=None)
        if self._stopping:
            return
        try:
            ray.get(ended[0])
            reason = "returned"
        except Exception as e:  # the follower's death, as Ray reports it
            reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        log.error("a tensor-parallel rank of this worker ended (%s); exiting", reason)
        os._exit(1)

    def stop(self) -> None:
        """Ends the followers' loops (on the engine thread's terms: after its last command)."""
        self._stopping = True
        self.executor.stop()
        dist.destroy_process_group()
        for follower in self.followers:
            ray.kill(follower)


def _reason(exc: Exception) -> str:
    """One line of why a rank's call failed: the rank's own exception, not Ray's wrapping and
    remote traceback."""
    cause = getattr(exc, "cause", None) or exc  # RayTaskError.cause: what the rank raised
    lines = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {lines[-1] if lines else ''}"
