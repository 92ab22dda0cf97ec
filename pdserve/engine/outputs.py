"""What the engine hands back: RequestOutput per step, Reservation for a decode handoff.

No torch import here: workers and the router pass these around as plain data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort", "prefill"]


@dataclass(slots=True)  # one per request per step (the planner makes millions): slots
class RequestOutput:
    """The tokens one request produced in one step (a delta, not the whole output so far)."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[float] | None = None  # set when SamplingParams.logprobs
    text_delta: str = ""
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (or transferred)
    block_ids: list[int] | None = None  # the held block table of a finished prefill_only request
    index: int = 0  # the choice (n > 1): `finished` ends this choice
    open_choices: int = 0  # choices of the request still generating after this output
    # Beam search, on a returned beam: its summed log-probability and its length-penalised score.
    cumulative_logprob: float | None = None
    score: float | None = None
    # Speculative decoding in this step: draft tokens the target verified for this request and
    # how many of them it accepted (0 and 0 when it did not speculate).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def ends_request(self) -> bool:
        """The request's last output: every choice has finished."""
        return self.finished and self.open_choices == 0


@dataclass
class Reservation:
    """A decode-side block table waiting for KV to arrive from a prefill worker."""

    num_cached_tokens: int  # prompt tokens already in this engine's prefix cache
    block_ids: list[int]  # the whole block table of the prompt
    missing_block_indices: list[int]  # positions in block_ids whose KV must be written
