"""The rank actors of a tensor-parallel worker (engine.tp > 1) and their process group.

Rank 0 is the worker actor the router sees (scheduler, block manager, prefix cache, KV events,
KV transfer endpoint: all on rank 0). When it starts it creates ranks 1..N-1 as `RankActor`s
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
from pathlib import Path

import ray
import torch.distributed as dist
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pdserve.engine.model_runner import TorchExecutor
from pdserve.engine.tp_executor import LeaderExecutor, follow
from pdserve.models.tensor_parallel import TensorParallel
from pdserve.worker.worker_spec import WorkerSpec

log = logging.getLogger(__name__)

# Followers wait in a broadcast for rank 0's next command however long the worker is idle, so
# the group's collectives must not time out; a rank that dies closes its connections, which
# fails the others' collectives at once.
IDLE_FOREVER = datetime.timedelta(days=365)
RENDEZVOUS_HOST = "127.0.0.1"  # STRICT_PACK: every rank is on rank 0's node


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
    """Rank r > 0 of a TP worker: its shard of the model and of the KV cache."""

    def serve(self, spec: WorkerSpec, rank: int, port: int) -> None:
        """Joins the group, loads this rank's shard and replays rank 0's commands until told to
        stop. A broken group ends this process: its worker restarts as a whole."""
        store = dist.TCPStore(RENDEZVOUS_HOST, port, spec.engine.tp, is_master=False)
        tp = _join(spec, store, rank)
        try:
            follow(_executor(spec, tp), tp)
        except Exception:
            log.exception("tensor-parallel rank %d lost its group; exiting", rank)
            os._exit(1)
        dist.destroy_process_group()


class RankGroup:
    """Rank 0's side: starts the followers, joins the group, watches them."""

    def __init__(self, worker_id: str, spec: WorkerSpec) -> None:
        size = spec.engine.tp
        store = dist.TCPStore(RENDEZVOUS_HOST, 0, size, is_master=True, wait_for_workers=False)
        actor_cls = ray.remote(RankActor)
        self.followers = [
            actor_cls.options(
                name=f"pdserve-{worker_id}-rank{rank}-{os.getpid()}",
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    spec.placement_group, placement_group_bundle_index=rank
                ),
                max_restarts=0,
                **spec.rank_options,
            ).remote()
            for rank in range(1, size)
        ]
        self._served = [
            f.serve.remote(spec, rank, store.port) for rank, f in enumerate(self.followers, 1)
        ]
        self.tp = _join(spec, store, 0)
        self.executor = LeaderExecutor(_executor(spec, self.tp), self.tp)
        self._stopping = False
        threading.Thread(target=self._watch, name="tp-rank-watch", daemon=True).start()

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
