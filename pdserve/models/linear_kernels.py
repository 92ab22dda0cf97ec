"""Which GEMM runs a CPU linear layer: measured on the machine at hand, cached per CPU.

The fastest way to multiply by a weight depends on the CPU, the dtype, the weight's shape and
the rows (BENCHMARKS.md: on an AVX-512 VM oneDNN over a reordered weight was 1.8x MKL at 32
rows, and MKL's x @ W^T was slow at 1-3 rows; on an AVX2-only EPYC those choices made pdserve
as slow as transformers). So nothing here is chosen by what was fastest on the development VM:

- PATHS are the candidates. A path the CPU cannot run is never one (oneDNN's bfloat16 reorder
  without AVX-512 or AVX-NE-CONVERT: cpu_features.runs_bf16_packed).
- `KernelChoices.choose` times the candidates on the layer's own weights for a rows bucket
  (single calls in interleaved rounds, the fastest call of each: other processes only ever
  add time), and keeps the fastest in a JSON file keyed by the CPU model, ISA, torch version,
  threads, dtype, shape and bucket, so later starts on that machine skip the measurement
  (delete the file to measure again).
- `choose_kernels(model, max_rows)` measures every bucket a model will meet at engine start;
  a bucket met later is measured when first met.

Every path computes the same product in the layer's dtype; results differ in rounding only.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from pdserve.config import default_cache_dir
from pdserve.models.cpu_features import CpuFeatures, cpu_features

CACHE_ENV = "PDSERVE_KERNEL_CACHE"
CACHE_VERSION = 1
# The row count oneDNN's weight layout is chosen for: decode batches; 1 chose a layout ~30%
# slower at 4-32 rows, 8 to 256 measured alike (the AVX-512 VM).
PACK_ROWS = 32
# Rows above this share one choice: large GEMMs run near the CPU's peak whichever path.
MAX_BUCKET = 256
# Rows up to this are their own bucket (where the paths differ most); above, powers of two.
EXACT_ROWS = 4
# The few-row path is only timed up to this many rows; above it never came near.
FEW_ROWS_MAX = 8
# Interleaved rounds per candidate. Timing a pass over all weights of a shape as one sample,
# 3 or 5 rounds let a loaded machine (load 10-15 on 2 cores) keep F.linear where oneDNN was
# 1.4-4x faster (BENCHMARKS.md, issue 44 section); single calls are timed now.
ROUNDS = 5
# Fewest timed calls per candidate (more rounds where a shape has few weights, as the LM head).
MIN_SAMPLES = 16
# Weights of one shape timed in turn, up to this many bytes: the model reads its layers' weights
# from memory, not from a cache that one reused weight would sit in.
MEASURE_BYTES = 32 << 20

ONEDNN = torch.backends.mkldnn.is_available() and hasattr(
    torch.ops.mkldnn, "_reorder_linear_weight"
)

# (x, weight, bias, packed weight or None) -> x @ weight^T + bias
GemmPath = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor
]


def plain(x, weight, bias, packed_weight):
    """x @ W^T through MKL (F.linear), which packs the weight again on every call."""
    return F.linear(x, weight, bias)


def few_rows(x, weight, bias, packed_weight):
    """(W @ x^T)^T: MKL's x @ W^T is slow at 1-3 rows on some CPUs; a single row is duplicated
    and run as two, as one row would be a matrix-vector product (as slow)."""
    rows = x.shape[0]
    wide = x.expand(2, -1).contiguous() if rows == 1 else x
    out = (weight @ wide.t()).t()[:rows].contiguous()
    return out if bias is None else out.add_(bias)


def packed(x, weight, bias, packed_weight):
    """oneDNN over the weight reordered once into its blocked layout (what torch.compile's CPU
    freezing does)."""
    return torch.ops.mkldnn._linear_pointwise.default(x, packed_weight, bias, "none", [], "")


PATHS: dict[str, GemmPath] = {"plain": plain, "few_rows": few_rows, "packed": packed}


def gemm(path: str, x, weight, bias, packed_weight) -> torch.Tensor:
    """The weight matmul through `path`: a module-level name, so that bench/step_phases.py can
    time every weight matmul of the model through it."""
    return PATHS[path](x, weight, bias, packed_weight)


def pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


def bucket(rows: int) -> int:
    """The rows a choice is measured at and shared by: 1..4 exact, then powers of two."""
    if rows <= EXACT_ROWS:
        return max(rows, 1)
    return min(1 << (rows.bit_length() - 1), MAX_BUCKET)


def buckets_up_to(max_rows: int) -> list[int]:
    return sorted({bucket(r) for r in range(1, min(max_rows, MAX_BUCKET) + 1)})


def candidates(dtype: torch.dtype, rows: int, cpu: CpuFeatures) -> list[str]:
    """The paths this CPU can run for `dtype` at `rows` (a bucket)."""
    names = ["plain"]
    if rows <= FEW_ROWS_MAX:
        names.append("few_rows")
    if ONEDNN and (dtype == torch.float32 or (dtype == torch.bfloat16 and cpu.runs_bf16_packed)):
        names.append("packed")
    return names


def fastest(calls: dict[str, list[Callable[[], object]]]) -> str:
    """The name whose calls (one per weight, each the same work) run fastest: each warmed once,
    then every call timed alone, in interleaved rounds; a name's fastest call counts. Single
    calls of a millisecond or less mostly run between two of the scheduler's preemptions, so
    the fastest of them stands even on a machine other processes load."""
    for runs in calls.values():
        for run in runs:
            run()
    best = dict.fromkeys(calls, float("inf"))
    per_round = min(len(runs) for runs in calls.values())
    for _ in range(max(ROUNDS, -(-MIN_SAMPLES // per_round))):
        for name, runs in calls.items():
            for run in runs:
                start = time.perf_counter()
                run()
                best[name] = min(best[name], time.perf_counter() - start)
    return min(best, key=best.__getitem__)


def default_cache_path() -> Path:
    return Path(os.environ.get(CACHE_ENV) or default_cache_dir() / "linear_kernels.json")


class KernelChoices:
    """The chosen path per (dtype, shape, rows bucket) on this CPU, backed by a JSON file."""

    def __init__(self, cache_path: Path | None = None, cpu: CpuFeatures | None = None) -> None:
        self.cache_path = cache_path or default_cache_path()
        self.cpu = cpu or cpu_features()
        self.measurements = 0  # choices measured by this instance (not read from the file)
        self._chosen: dict[tuple, str] = {}
        self._stored = self._read()

    def _file_key(self, dtype: torch.dtype, shape: tuple[int, ...], rows: int) -> str:
        # A choice holds for one CPU model at one ISA, torch build and thread count.
        machine = (self.cpu.model, self.cpu.isa, torch.__version__, torch.get_num_threads())
        return "|".join(map(str, (*machine, str(dtype).removeprefix("torch."), shape, rows)))

    def choose(self, weights: Iterable[torch.Tensor], bias: torch.Tensor | None, rows: int) -> str:
        """The path for `rows` (any count) through weights of this shape and dtype: from memory,
        the cache file, or measured on `weights` (the first alone would do; more are timed in
        turn, up to MEASURE_BYTES)."""
        weights = iter(weights)
        first = next(weights)
        rows = bucket(rows)
        key = (first.dtype, tuple(first.shape), rows, torch.get_num_threads())
        if key in self._chosen:
            return self._chosen[key]
        names = candidates(first.dtype, rows, self.cpu)
        file_key = self._file_key(first.dtype, tuple(first.shape), rows)
        chosen = self._stored.get(file_key)
        if chosen not in names:  # absent, or a path this CPU no longer offers
            chosen = self._measure(names, [first, *_up_to_bytes(weights, first)], bias, rows)
            self.measurements += 1
            self._stored[file_key] = chosen
            self._write(file_key, chosen)
        self._chosen[key] = chosen
        return chosen

    def _measure(self, names, weights, bias, rows: int) -> str:
        x = torch.randn(rows, weights[0].shape[1], dtype=weights[0].dtype)
        packs = [pack(w) for w in weights] if "packed" in names else [None] * len(weights)

        def calls(path: GemmPath) -> list[Callable[[], torch.Tensor]]:
            return [partial(path, x, w, bias, p) for w, p in zip(weights, packs, strict=True)]

        with torch.inference_mode():
            return fastest({name: calls(PATHS[name]) for name in names})

    def _read(self) -> dict[str, str]:
        """The cache file's choices; a missing, unreadable or foreign file counts as empty (it
        is rewritten whole at the next choice)."""
        try:
            data = json.loads(self.cache_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
            return {}
        choices = data.get("choices")
        if not isinstance(choices, dict):
            return {}
        return {k: v for k, v in choices.items() if isinstance(v, str) and v in PATHS}

    def _write(self, file_key: str, chosen: str) -> None:
        """Merges into what is on disk now (other workers on this machine write it too) and
        replaces the file in one rename. A cache that cannot be written only costs a later
        start its measurement."""
        merged = {**self._read(), file_key: chosen}
        tmp = self.cache_path.with_name(f"{self.cache_path.name}.{os.getpid()}.tmp")
        try:
            self.cache_path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(
                json.dumps({"version": CACHE_VERSION, "choices": merged}, indent=1, sort_keys=True),
                encoding="utf-8",
            )
            os.replace(tmp, self.cache_path)
        except OSError:
            tmp.unlink(missing_ok=True)


def _up_to_bytes(weights: Iterable[torch.Tensor], first: torch.Tensor) -> list[torch.Tensor]:
    more, size = [], first.nbytes
    for weight in weights:
        if size >= MEASURE_BYTES:
            break
        more.append(weight)
        size += weight.nbytes
    return more


_choices: KernelChoices | None = None


def kernel_choices() -> KernelChoices:
    """The process's choices, read from the cache file on first use."""
    global _choices
    if _choices is None:
        _choices = KernelChoices()
    return _choices
