"""The engine's settings: `EngineConfig` (model, KV pool, batching, compile, async scheduling)
and the sub-settings it carries, `SimConfig` (simulated workers) and `SpeculativeConfig`. Each
is a dataclass of `setting()` fields (config_fields.py), read by `pdserve serve`'s flags like
the serving settings of config.py, which holds one EngineConfig per worker pool.

Kept free of torch and Ray imports: the router and the CLI read them too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import ClassVar

from pdserve.config_fields import ConfigError, MiB, check_fields, setting
from pdserve.sim.profiles import ProfileError, parse_profile

ENGINE_KINDS = ("torch", "sim")


@dataclass
class SimConfig:
    """Simulated workers (--engine sim): the timing model that stands for the GPU."""

    cli_group: ClassVar[str] = "simulation"

    profile: str = setting(
        "analytical:h100",
        "timing model: analytical:GPU[:tpN] (GPUs: a100, h100, h200, l40s) or a JSON profile "
        "file (docs/simulation.md)",
        flag="--sim-profile",
    )
    time_scale: float = setting(
        1.0,
        "wall seconds per simulated second (stretch to fit many workers)",
        flag="--sim-time-scale",
        above=0,
    )
    link_gbps: float = setting(
        400.0,
        "bandwidth of the modelled prefill-to-decode KV link in Gbit/s",
        flag="--sim-link-gbps",
        above=0,
    )
    # The links of the sim host and disk tiers (--kv-offload-gb, --kv-disk-gb; the defaults'
    # sources: pdserve/sim/kv_tiers.py).
    host_link_gbs: float = setting(
        50.0, "host-to-device bandwidth of the modelled host tier, GB/s", flag="--sim-host-link-gbs",
        above=0,
    )  # fmt: skip
    host_link_latency_us: float = setting(
        10.0, "cost of each block copied back from the modelled host tier, microseconds",
        flag="--sim-host-link-latency-us", minimum=0,
    )  # fmt: skip
    disk_read_gbs: float = setting(
        6.0, "read bandwidth of the modelled disk tier, GB/s", flag="--sim-disk-read-gbs", above=0
    )
    disk_read_latency_us: float = setting(
        100.0, "cost of each block read from the modelled disk tier, microseconds",
        flag="--sim-disk-read-latency-us", minimum=0,
    )  # fmt: skip

    def __post_init__(self) -> None:
        check_fields(self)
        try:
            parse_profile(self.profile)
        except ProfileError as e:
            raise ConfigError("SimConfig", "profile", str(e)) from None


SPECULATIVE_METHODS = ("", "ngram", "draft")


@dataclass
class SpeculativeConfig:
    """Speculative decoding in the torch engine (docs/decoding.md, "Speculative decoding"):
    each step a proposer guesses up to `num_speculative_tokens` next tokens of each running
    decode sequence and one target forward verifies them all. Not with --engine sim.

    The engine switches proposing off by itself when it does not pay: when its decode steps,
    timed with and without drafts, show speculation slower than plain decoding, or, before any
    plain step was timed, while the acceptance rate (accepted / drafted tokens) over the last
    `acceptance_window` drafted tokens stays below `min_acceptance` (0 turns the switch-off
    off). It probes again (one token of one sequence) after `probe_interval` steps, waiting
    twice as long after each pause (at most 16 times as long) until a window pays
    (docs/decoding.md, "Speculative decoding")."""

    cli_group: ClassVar[str] = "speculative decoding"

    method: str = setting(
        "",
        "propose tokens to verify in one forward: ngram (prompt lookup) or draft (a smaller "
        "model, --draft-model); empty = off",
        flag="--speculative",
        choices=SPECULATIVE_METHODS,
    )
    draft_model: str | None = setting(
        None, "Hugging Face directory of the draft model (same tokenizer as the target)"
    )
    num_speculative_tokens: int = setting(
        4, "most tokens proposed per sequence and step", minimum=1, maximum=16
    )
    ngram_max: int = setting(
        3, "longest suffix n-gram prompt lookup matches", flag="--spec-ngram-max", minimum=1
    )
    ngram_min: int = setting(
        1, "shortest suffix n-gram prompt lookup matches", flag="--spec-ngram-min", minimum=1
    )
    min_acceptance: float = setting(
        0.4,
        "below this acceptance rate (accepted / drafted) speculation pauses itself until its "
        "steps are timed; 0 = never pause",
        flag="--spec-min-acceptance",
        minimum=0,
        maximum=1,
    )
    acceptance_window: int = setting(
        16, "drafted tokens the acceptance rate is measured over", flag="--spec-window", minimum=1
    )
    probe_interval: int = setting(
        32,
        "steps a paused speculation waits before proposing again",
        minimum=1,
        flag="--spec-probe-interval",
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if self.method == "draft" and not self.draft_model:
            raise ConfigError(
                "SpeculativeConfig", "draft_model", "--speculative draft needs --draft-model DIR"
            )
        if self.ngram_min > self.ngram_max:
            raise ConfigError("SpeculativeConfig", "ngram_min", "must be at most ngram_max")

    @property
    def enabled(self) -> bool:
        return bool(self.method)


@dataclass
class EngineConfig:
    """One engine (any role): which model, how big the paged KV cache is, how a step is batched."""

    cli_group: ClassVar[str] = "engine"

    model: str | None = setting(None, "Hugging Face model directory (default: built-in tiny model)")
    dtype: str = setting(
        "float32", "weights and KV cache", choices=("float32", "bfloat16", "float16")
    )
    device: str = setting("cpu", "cpu, cuda or cuda:N")
    block_size: int = setting(16, "tokens per KV block", minimum=1)
    num_kv_blocks: int | None = setting(
        None, "exact KV pool size in blocks; overrides --kv-cache-mb", minimum=1
    )
    kv_cache_bytes: int = setting(
        256 * MiB, "KV pool size in MiB", flag="--kv-cache-mb", unit=MiB, minimum=1
    )
    kv_offload_gb: float = setting(
        0.0,
        "host memory (GiB) that keeps the prefix-cache blocks evicted from the KV pool, to be "
        "copied back instead of recomputed (pinned on CUDA; under tensor parallelism each "
        "rank keeps its heads' share); 0 = off (torch engine, or sim: a modelled tier, "
        "--sim-host-link-gbs)",
        minimum=0,
    )
    kv_disk_dir: str | None = setting(
        None,
        "directory of the disk tier under --kv-offload-gb: blocks the host tier evicts are "
        "written there (one file each, checksummed) instead of dropped; files of dead runs "
        "are deleted at start",
    )
    kv_disk_gb: float = setting(
        0.0,
        "disk space (GiB) of --kv-disk-dir's tier, file headers included; 0 = off (not yet "
        "under tensor parallelism)",
        minimum=0,
    )
    max_num_seqs: int = setting(64, "most sequences in one step", minimum=1)
    max_num_batched_tokens: int = setting(
        1024, "token budget of one step (prefill chunks + decodes)", minimum=1
    )
    max_model_len: int | None = setting(
        None,
        "longest prompt + output; default and cap: the model's max_position_embeddings, "
        "sliding window and KV pool",
        minimum=1,
    )
    enable_prefix_caching: bool = setting(
        True, "reuse KV blocks of shared prompt prefixes", flag="--prefix-caching"
    )
    enable_chunked_prefill: bool = setting(
        True, "split long prompts over several steps", flag="--chunked-prefill"
    )
    num_threads: int | None = setting(
        None, "torch intra-op threads per worker on CPU (default: torch's)", minimum=1
    )
    compile: bool | None = setting(
        None,
        "run decode-only steps as a compiled static-shape graph (torch.compile; CUDA graphs "
        "on CUDA); default: on for CUDA, off on CPU",
    )
    async_scheduling: bool | None = setting(
        None,
        "schedule and launch the next plain greedy decode step while the current one runs, its "
        "tokens landing one step later (vLLM's async scheduling); default: on for CUDA, off on "
        "CPU (where the host runs the model itself)",
    )
    gpu_memory_utilization: float = setting(
        0.9,
        "share of the GPU's memory the worker may use; on CUDA the KV pool gets what weights "
        "and a profiled forward pass leave (--num-kv-blocks overrides); CPU uses --kv-cache-mb",
        above=0,
        maximum=1,
    )
    # Tensor-parallel ranks that run this engine's model together (pdserve serve's
    # --prefill-tp / --decode-tp); each rank holds 1/tp of the layers and a KV pool of its own
    # heads, sized per rank (model_limits.kv_bytes_per_block).
    tp: int = setting(1, "tensor-parallel ranks of one worker", minimum=1, cli=False)
    # pdserve serve's --expert-parallel: the MoE layers of a TP worker dispatch tokens to their
    # experts' ranks with all_to_all (pdserve/models/expert_dispatch.py).
    expert_parallel: bool = setting(
        False, "dispatch MoE tokens to experts' ranks with all_to_all", cli=False
    )
    kind: str = setting(
        "torch",
        "what runs the model: torch, or sim (a timing model, no torch; docs/simulation.md)",
        flag="--engine",
        choices=ENGINE_KINDS,
    )
    sim: SimConfig = field(default_factory=SimConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        check_fields(self)
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ConfigError(
                "EngineConfig", "device", f"must be cpu, cuda or cuda:N, got {self.device!r}"
            )
        if self.kv_disk_gb and not self.kv_disk_dir and self.kind != "sim":  # sim: no files
            raise ConfigError("EngineConfig", "kv_disk_gb", "needs --kv-disk-dir DIR")
        if self.kv_disk_gb and not self.kv_offload_gb:
            # Blocks reach the disk through the host tier (engine/host_tier.py).
            raise ConfigError("EngineConfig", "kv_disk_gb", "needs --kv-offload-gb (the host tier)")
