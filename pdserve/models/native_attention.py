"""The CPU decode-attention kernel that reads the paged KV cache in place (csrc/
paged_decode_attention.cpp), and the build of the `pdserve_native` library it lives in, with
the fused small ops of native_ops.py (csrc/fused_ops.cpp) and the seeded draw of
engine/decoding/seeded_draw.py (csrc/seeded_draw.cpp).

Plain torch has no op that attends over a block table: `attention.paged_attention` gathers every
sequence's whole context out of the pool each layer, and SDPA copies it once more. This kernel
walks each sequence's blocks where they lie (BENCHMARKS.md, issue 19: the gather and SDPA were
a quarter of a batch-32 decode step on CPU). It serves decode rows (one query per sequence);
prefill chunks and drafts keep the torch path (GPUs: triton_attention.py).

torch's C++ extension loader compiles the library once per machine (about 40 s with g++ on 2
cores) into a folder of TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions) named by a hash
of the sources, flags, torch version and CPU capability (the build targets the CPU it runs on,
-march=native); concurrent first builds wait on the loader's lock, and later processes load
the library directly. When it cannot be built (no compiler, no ninja) or
`PDSERVE_NATIVE_ATTENTION=0`, the torch path runs, after one warning: that switch turns off the
kernel, the fused ops and the fused seeded draw together.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / "paged_decode_attention.cpp", CSRC / "fused_ops.cpp", CSRC / "seeded_draw.cpp"]
HEADERS = [CSRC / "float_io.h"]  # included by the sources: part of what a build depends on
# -fopenmp: at::parallel_for's OpenMP loop (the build links torch's own libgomp); -ffast-math
# lets the dot products and exp vectorize (a rounding-level difference from SDPA's order).
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
DISABLE_ENV = "PDSERVE_NATIVE_ATTENTION"
NAME = "pdserve_native"


def _build_directory() -> Path:
    """Where the build lives: TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions), in a
    folder named by everything the binary depends on (the sources, the flags, torch's version
    and the CPU capability it was built for), so a changed source or another CPU gets its own
    build and an existing one is always current."""
    capability = torch.backends.cpu.get_cpu_capability()
    key = "\0".join(
        [*(f.read_text() for f in (*SOURCES, *HEADERS)), *CFLAGS, torch.__version__, capability]
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(root) / f"{NAME}-{capability.lower()}-{digest}"


@functools.cache
def enabled() -> bool:
    """Whether decode attention on CPU goes through the kernel (and the fused ops of
    native_ops.py are there): not switched off by PDSERVE_NATIVE_ATTENTION=0, and built here
    (on the first call: loaded from the cache or compiled)."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        log.info(
            "%s=0: decode attention gathers the KV blocks, no fused ops (plain torch)", DISABLE_ENV
        )
        return False
    build_dir = _build_directory()
    library, built = build_dir / f"{NAME}.so", build_dir / "built"
    try:
        if built.exists():
            # Built before on this machine: load it as is. torch's loader would take
            # its build lock and run ninja again in every new process, and a process killed
            # while holding that lock would stall every later start. (Not `library.exists()`:
            # the linker writes the library in place, so a process starting during a build
            # could find half of it.)
            torch.ops.load_library(str(library))
        else:
            from torch.utils import cpp_extension

            # Loaded as a library: its TORCH_LIBRARY block registers torch.ops.pdserve_native.
            build_dir.mkdir(parents=True, exist_ok=True)
            cpp_extension.load(
                NAME,
                [str(source) for source in SOURCES],
                extra_cflags=CFLAGS,
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=False,
            )
            built.touch()  # after the loader returned: the library is whole
        return True
    except Exception as exc:  # no compiler or ninja, a failed build: the torch path still works
        log.warning(
            "the CPU decode-attention kernel and fused ops could not be built (%s); decode "
            "attention gathers the KV blocks and the layers run plain torch ops instead (slower)",
            str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__,
        )
        return False


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D], one query per sequence (rope applied)
    layer_cache: torch.Tensor,  # [2, num_blocks, block_size, KV, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int64
    context_lens: torch.Tensor,  # [B] int64: sequence b attends over its first context_lens[b] slots
) -> torch.Tensor:  # [B, H * D]
    """Attention of each sequence's query over its context, read in place (`enabled()` first)."""
    out = torch.ops.pdserve_native.paged_decode_attention(
        q, layer_cache, block_tables, context_lens
    )
    return out.view(q.shape[0], -1)
