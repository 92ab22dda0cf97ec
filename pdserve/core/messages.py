"""Messages between the router and the workers (through Ray calls): plain dataclasses.

No torch here: the router imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.core.sampling_params import SamplingParams


@dataclass
class WorkRequest:
    """One request as a worker sees it: already tokenized and validated by the router."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    trace_context: dict[str, str] = field(default_factory=dict)  # W3C traceparent/tracestate


@dataclass
class KVReservation:
    """A decode worker's promise to take a prompt's KV: the blocks it lacks, by a deadline."""

    decode_worker: str
    transfer_id: str  # unguessable capability issued by the decode worker
    endpoint: str  # the decode worker's KV server, "host:port"
    missing_block_indices: list[int]  # positions in the prompt's block table to send
    num_cached_tokens: int  # prompt tokens the decode worker already holds
    deadline: float  # unix time after which the reservation is freed
    transport: str = "grpc"
    # Every decode rank's KV endpoint, in rank order ([endpoint] on one device): a
    # tensor-parallel handoff sends each rank its heads there (kv_transfer/tp_handoff.py).
    rank_endpoints: list[str] = field(default_factory=list)


@dataclass
class PrefillResult:
    """What a prefill worker returns once the KV is on the decode worker (or the request ended)."""

    request_id: str
    worker_id: str
    first_token_id: int
    first_logprob: float | None
    finished: bool  # the first token already ended the request (stop token, max_tokens=1)
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int  # prefix-cache hits on the prefill worker
    queue_s: float  # waiting in the prefill worker before compute
    prefill_s: float  # prefill compute
    transfer_s: float = 0.0  # pushing KV and committing
    transfer_bytes: int = 0
    transfer_chunks: int = 0


@dataclass
class TokenBatch:
    """Tokens a worker produced since its previous batch for one choice of a request (one or
    more steps). `finished` ends the choice; the request ends when all its choices have."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    index: int = 0  # the choice (n > 1 or beam search; 0 = the best beam)
    score: float | None = None  # beam search, on the choice's last batch: the beam's score
    # Beam search, on the choice's last batch: the sum of its tokens' log-probabilities.
    cumulative_logprob: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # Set on a local prefill's first batch: how long the prompt waited and computed.
    queue_s: float | None = None
    prefill_s: float | None = None
    # Speculative decoding over the batch's steps: draft tokens verified, and accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # On an "abort" batch the worker sent unasked: why (its engine step failed), else "".
    error: str = ""


# WorkerStats fields that are the engine's own counts (LLMEngine.stats() keys of one name).
ENGINE_COUNT_FIELDS = (
    "num_waiting",
    "num_running",
    "num_reserved",
    "num_held",
    "waiting_prompt_tokens",
    "num_blocks",
    "num_free_blocks",
    "num_used_blocks",
    "num_cached_blocks",
    "num_evictable_blocks",
    "prefix_hit_tokens",
    "prefix_query_tokens",
    "prefix_host_hit_tokens",
    "prefix_disk_hit_tokens",
    "prefix_peer_hit_tokens",
    "peer_pulls_started",
    "peer_pulls_committed",
    "peer_pulls_fallen_back",
    "num_host_blocks",
    "num_host_cached_blocks",
    "host_copy_bytes_per_s",
    "num_disk_blocks",
    "num_disk_cached_blocks",
    "disk_read_bytes_per_s",
    "spec_draft_tokens",
    "spec_accepted_tokens",
    "spec_verify_steps",
    "spec_paused",
)


@dataclass
class WorkerStats:
    """A worker's load and its measured costs; the router polls it for routing."""

    worker_id: str
    role: str  # "prefill" | "decode"
    epoch: int  # changes when the actor restarts
    num_waiting: int = 0
    num_running: int = 0
    num_reserved: int = 0
    num_held: int = 0
    waiting_prompt_tokens: int = 0  # uncomputed prompt tokens queued on this worker
    num_blocks: int = 0
    num_free_blocks: int = 0
    num_used_blocks: int = 0
    num_cached_blocks: int = 0
    # Of num_free_blocks, those holding a cached prefix that an allocation would evict.
    num_evictable_blocks: int = 0
    block_size: int = 16
    bytes_per_block: int = 0  # KV bytes of one block over all layers (for transfer estimates)
    # Cumulative measurements: the router's cost model differentiates them between polls.
    prefill_tokens: int = 0  # prompt tokens computed
    prefill_seconds: float = 0.0  # time spent in steps that computed prompt tokens
    prefill_steps: int = 0  # those steps (their decodes, if any, ran in them too)
    decode_steps: int = 0  # steps that only decoded
    decode_seconds: float = 0.0
    decode_tokens: int = 0  # tokens produced by those steps (sum of batch sizes)
    prefix_hit_tokens: int = 0  # in any tier
    prefix_query_tokens: int = 0
    prefix_host_hit_tokens: int = 0  # of prefix_hit_tokens, those brought back from host memory
    num_host_blocks: int = 0  # the host tier's capacity (--kv-offload-gb), in blocks
    num_host_cached_blocks: int = 0
    host_copy_bytes_per_s: int = 0  # host-to-device copy bandwidth, measured at start
    prefix_disk_hit_tokens: int = 0  # of prefix_hit_tokens, those read back from the disk tier
    # Of prefix_hit_tokens, those pulled from a peer worker's cache (docs/design.md, "Peer
    # pull"); and the pulls into this worker: reserved, committed, fallen back to a prefill.
    prefix_peer_hit_tokens: int = 0
    peer_pulls_started: int = 0
    peer_pulls_committed: int = 0
    peer_pulls_fallen_back: int = 0
    num_disk_blocks: int = 0  # the disk tier's capacity (--kv-disk-gb), in blocks
    num_disk_cached_blocks: int = 0
    disk_read_bytes_per_s: int = 0  # file-to-device bandwidth, mean of the reads so far
    transfer_bytes: int = 0  # KV bytes sent (prefill) or received (decode)
    transfer_seconds: float = 0.0
    transfer_failures: int = 0
    # Speculative decoding since the worker started: draft tokens verified, draft tokens
    # accepted, and verify steps (one per sequence per step that verified drafts).
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verify_steps: int = 0
    spec_paused: int = 0  # 1 while the worker's speculation has switched itself off
    # Sim workers (docs/simulation.md), in simulated seconds: the timing model's step time, the
    # steps' wall time divided by the time scale, and steps whose Python work alone overran.
    sim_modelled_seconds: float = 0.0
    sim_measured_seconds: float = 0.0
    sim_overrun_steps: int = 0
    # A mixture of experts since the worker started: tokens routed to each expert (summed over
    # the sparse layers), and the busiest (layer, expert)'s tokens over the mean (1 = even).
    expert_tokens: list[int] = field(default_factory=list)
    expert_load_imbalance: float = 0.0
    # Peak memory of the worker process since it started: resident set size, and bytes the
    # CUDA allocator held (0 on CPU). Budget: weights + KV pool + allowance (docs/design.md).
    peak_rss_bytes: int = 0
    peak_gpu_bytes: int = 0
    # The latest engine step's failure ("RuntimeError: ..."), "" once a step succeeds again.
    engine_failure: str = ""
