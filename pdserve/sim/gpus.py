"""GPU spec-sheet numbers the analytical timing model starts from (sources: docs/simulation.md).

Peak FLOP/s are dense (no structured sparsity) BF16 tensor-core figures; `link_bytes_per_s` is
the GPU-to-GPU bandwidth in one direction that tensor-parallel all-reduces use, and
`link_hop_s` the latency of one step of a ring over that link: NCCL's own cost model
(NVIDIA/nccl src/graph/tuning.cc, `hwLat`, Ring with the LL protocol of small messages such as
a decode step's hidden states) takes 0.47 us per hop over NVLink and 1.0 us over PCIe.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 10**9
TB = 10**12


@dataclass(frozen=True)
class GPUSpec:
    name: str
    bf16_flops: float  # dense peak FLOP/s
    hbm_bytes_per_s: float
    memory_bytes: int
    link_bytes_per_s: float  # NVLink (or PCIe) bandwidth per direction, for TP all-reduces
    link_hop_s: float  # latency of one ring step over that link


US = 1e-6
NVLINK_HOP_S = 0.47 * US
PCIE_HOP_S = 1.0 * US

GPUS: dict[str, GPUSpec] = {
    "h100": GPUSpec("NVIDIA H100 SXM5 80GB", 989 * TB, 3.35 * TB, 80 * GB, 450 * GB, NVLINK_HOP_S),
    "h200": GPUSpec("NVIDIA H200 SXM 141GB", 989 * TB, 4.8 * TB, 141 * GB, 450 * GB, NVLINK_HOP_S),
    "a100": GPUSpec("NVIDIA A100 SXM4 80GB", 312 * TB, 2.039 * TB, 80 * GB, 300 * GB, NVLINK_HOP_S),
    "l40s": GPUSpec("NVIDIA L40S 48GB", 362.05 * TB, 0.864 * TB, 48 * GB, 32 * GB, PCIE_HOP_S),
}


def gpu_spec(name: str) -> GPUSpec:
    """The spec of `name` (case-insensitive); KeyError naming the known GPUs otherwise."""
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise KeyError(f"unknown GPU {name!r} (known: {', '.join(sorted(GPUS))})") from None
