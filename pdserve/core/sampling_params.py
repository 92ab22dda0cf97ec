"""SamplingParams: how one request picks its tokens and when it stops.

No torch import here: the router validates and builds these before any engine is involved.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Temperatures below this are greedy: dividing logits by them overflows float32 to inf, and a
# softmax over infinities samples an arbitrary token instead of the most likely one.
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    """Per-request sampling settings. temperature < GREEDY_TEMPERATURE (0 included) means greedy
    (top_k/top_p/seed unused)."""

    max_tokens: int = 64  # most tokens generated, the first one included
    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1.0 = no nucleus filter
    seed: int | None = None  # token n is drawn from a generator seeded by (seed, seed_offset + n)
    # Tokens generated before this prompt ended: a continuation whose prompt carries them
    # draws from the seeded stream where the interrupted run left off.
    seed_offset: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # stop strings; matched text is not emitted
    ignore_eos: bool = False
    logprobs: bool = False  # return the log-probability of each chosen token

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed_offset < 0:
            raise ValueError(f"seed_offset must be >= 0, got {self.seed_offset}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE
