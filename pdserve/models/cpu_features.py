"""What this process's CPU is and which of its vector units torch and oneDNN will use.

Read from what the libraries themselves obey, so that the emulation of an older CPU by
`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2` (how an AVX-512 machine measures an
AVX2-only one) is seen as that CPU: torch's dispatch capability, oneDNN's bfloat16 support,
and /proc/cpuinfo for the model name and the flags neither reports (AMX, AVX-NE-CONVERT).
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch


@dataclass(frozen=True)
class CpuFeatures:
    model: str  # /proc/cpuinfo's "model name", e.g. "AMD EPYC"
    capability: str  # torch's dispatch level: "AVX512", "AVX2", "DEFAULT" (or another arch's)
    flags: frozenset[str]  # /proc/cpuinfo's flags: what the hardware has, whatever is forced
    onednn_bf16: bool  # oneDNN runs bfloat16 matmuls natively (its ISA limit included)

    @property
    def isa(self) -> str:
        """The widest vector unit in use: "AMX", "AVX-512", "AVX2" or torch's own name."""
        if self.capability == "AVX512":
            return "AMX" if self.onednn_bf16 and "amx_tile" in self.flags else "AVX-512"
        return self.capability

    @property
    def runs_bf16_packed(self) -> bool:
        """oneDNN's bfloat16 linear over a reordered weight needs AVX-512 (BW, VL, DQ) or
        AVX-NE-CONVERT; elsewhere its reorder refuses. A capability forced down to AVX2 counts
        as having neither AVX-512, whatever oneDNN was allowed."""
        native = self.capability == "AVX512" or "avx_ne_convert" in self.flags
        return self.onednn_bf16 and native

    def describe(self) -> str:
        """One line for benchmark output: the model and the ISA the kernels run with."""
        notes = [self.isa] if self.isa == "AMX" else [self.isa, "no AMX"]
        if self.isa not in {"AMX", "AVX-512"} and "avx512f" in self.flags:
            notes.append("AVX-512 present, turned off by ATEN_CPU_CAPABILITY/ONEDNN_MAX_CPU_ISA")
        return f"{self.model} ({', '.join(notes)})"


def _cpuinfo_field(name: str) -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return ""
    for line in cpuinfo.read_text(encoding="utf-8", errors="replace").splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return ""


@cache
def cpu_features() -> CpuFeatures:
    """This process's CPU; fixed for its life (the env vars are read by the libraries once)."""
    return CpuFeatures(
        model=_cpuinfo_field("model name") or platform.processor() or platform.machine(),
        capability=torch.backends.cpu.get_cpu_capability(),
        flags=frozenset(_cpuinfo_field("flags").split()),
        onednn_bf16=torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported(),
    )
