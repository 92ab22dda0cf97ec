"""Peak memory of this worker process, for WorkerStats: resident set size from getrusage and
the CUDA allocator's peak when torch has initialized CUDA (a sim worker never imports torch)."""

from __future__ import annotations

import resource
import sys

# What a worker process holds besides the model weights and the KV pool: the interpreter,
# torch, Ray's core worker, gRPC and their heaps, activations of one step. A worker's budget is
# weights + KV pool bytes + this; tests/worker/test_worker_memory.py checks a live worker.
PROCESS_ALLOWANCE_BYTES = 2 * 2**30


def peak_rss_bytes() -> int:
    """The process's peak resident set size (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def peak_gpu_bytes() -> int:
    """Peak bytes the CUDA caching allocator held on the current device; 0 without CUDA."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return 0
    return torch.cuda.max_memory_reserved()
