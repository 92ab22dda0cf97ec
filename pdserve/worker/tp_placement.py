"""Checks, before any actor starts, that each pool's tensor-parallel degree can work: the model
splits that way (and has experts, under --expert-parallel), and some node can hold a whole
worker (its ranks share one node: STRICT_PACK). Each failure is one line naming the flag and the numbers (a placement group that no node can
hold would otherwise wait forever). No torch: the router process runs these."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pdserve.config import ServeConfig
from pdserve.core import model_limits
from pdserve.startup_checks import StartupError

_EXPERT_COUNTS = ("num_experts", "num_local_experts")  # config.json keys of MoE models


def check_tensor_parallel(
    config: ServeConfig, model_dir: Path, nodes: list[dict[str, Any]]
) -> None:
    """StartupError naming the flag when a pool's TP cannot split the model of `model_dir` or
    no alive node of `nodes` (ray.nodes()) can hold one of its workers."""
    hf_config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    if config.expert_parallel and not any(k in hf_config for k in _EXPERT_COUNTS):
        raise StartupError(
            f"--expert-parallel: {model_dir / 'config.json'} declares no experts (neither "
            "num_experts nor num_local_experts): expert parallelism is for MoE models"
        )
    for role in ("prefill", "decode"):
        tp = config.engine_for(role).tp
        workers = config.prefill_workers if role == "prefill" else config.decode_workers
        if tp == 1 or workers == 0:
            continue
        try:
            model_limits.check_tensor_parallel(hf_config, tp)
        except ValueError as e:
            raise StartupError(f"--{role}-tp: {e}") from None
        resource = getattr(config, f"{role}_pool_resource")
        problem = _no_node_holds(
            nodes, resource, tp, config.gpus_per_worker, config.cpus_per_worker
        )
        if problem:
            raise StartupError(f"--{role}-tp {tp}: {problem}")


def _no_node_holds(
    nodes: list[dict[str, Any]], resource: str, tp: int, gpus: float, cpus: float
) -> str | None:
    """Why no alive node with `resource` holds `tp` ranks of `gpus` GPUs and `cpus` CPUs each
    (a CPU rank needs a core of its own at least: its collectives wait on the others), or None."""
    need_gpus = tp * gpus
    need_cpus = tp * cpus if cpus else (0 if gpus else tp)
    pool = [n["Resources"] for n in nodes if n.get("Alive") and n["Resources"].get(resource, 0) > 0]
    if not pool:
        return None  # no pool node yet (an autoscaler may add one): Ray places it when it comes
    if any(r.get("GPU", 0) >= need_gpus and r.get("CPU", 0) >= need_cpus for r in pool):
        return None
    most_gpus = max(r.get("GPU", 0) for r in pool)
    most_cpus = max(r.get("CPU", 0) for r in pool)
    return (
        f"a worker needs {need_gpus:g} GPUs and {need_cpus:g} CPUs on one node "
        f"({tp} ranks x --gpus-per-worker {gpus:g} / --cpus-per-worker {cpus:g}); the "
        f"{resource} nodes have at most {most_gpus:g} GPUs and {most_cpus:g} CPUs"
    )
