"""Sequence: one request's state inside the engine. Its status changes only in the engine
and the scheduler, through `status`.

token_ids = prompt + generated tokens. The first `num_computed_tokens` of them have their K/V
in the blocks of `block_table`; a step computes the next chunk and, once all are computed,
samples one more token. With speculative decoding the last `num_draft_tokens` of token_ids are
a proposer's guesses, appended for one step to be verified (the step computes them with the
last real token); the engine keeps those of them the target accepts and drops the rest. A request with n > 1 has one sequence per choice (`index`), forked
from the first when its prompt is computed: `pending_forks` lists the choices still to fork.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from pdserve.core.sampling_params import SamplingParams
from pdserve.tokenizer import IncrementalDetokenizer


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued (new, or preempted and to be recomputed)
    RUNNING = "running"  # in the batch: prefilling in chunks, or decoding
    HELD = "held"  # prefill_only and done: blocks kept for a KV transfer until release()
    RESERVED = "reserved"  # decode handoff: blocks allocated, KV arriving, awaiting commit()
    FINISHED = "finished"


# eq=False: a sequence is itself (identity), so removing one from a queue compares pointers,
# not every field of every sequence queued before it.
@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    arrival: int  # admission order: the latest-arrived running sequence is preempted first
    prefill_only: bool = False
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    # Chained hashes of the full blocks of token_ids seen so far (prefix caching).
    block_hashes: list[int] = field(default_factory=list)
    # Chained hashes of the prompt's full blocks: computed once when first needed
    # (BlockManager.prompt_hashes), or given with the prompt (PromptTokens).
    prompt_block_hashes: list[int] | tuple[int, ...] | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    num_host_hit_tokens: int = 0  # of those, the ones brought back from the host tier
    num_disk_hit_tokens: int = 0  # and those read back from the disk tier
    admitted: bool = False  # has been scheduled once (later admissions are recomputes)
    # Whether its blocks may enter the prefix cache: not when its KV came from a peer this
    # engine does not trust (the KV of every later token depends on it).
    cache_blocks: bool = True
    output_logprobs: list[float] = field(default_factory=list)
    detokenizer: IncrementalDetokenizer | None = None
    finish_reason: str | None = None
    index: int = 0  # the choice of its request this sequence generates
    # Choices forked from this sequence in the step that computes its last prompt token: they
    # share its blocks and sample their first tokens from its logits.
    pending_forks: list[int] = field(default_factory=list)
    # A beam of a beam-search request: how many (token, log-probability) candidates its
    # sampling row offers (0 = not a beam; it samples a token instead).
    beam_top_k: int = 0
    # Speculative decoding: the last num_draft_tokens of token_ids are unverified guesses (only
    # between the engine's proposing and verifying in one step); draft_probs, when not None,
    # is the draft's distribution q of each (a [num_draft_tokens, vocab] tensor).
    num_draft_tokens: int = 0
    draft_probs: Any = None
    # The tokens masked while the output is shorter than params.min_tokens (the sampler sets
    # their logits to -inf): its stop_token_ids and, unless ignore_eos, the model's EOS ids.
    # Empty when min_tokens is 0.
    min_tokens_mask: tuple[int, ...] = ()
    # A plain decode that may be scheduled before its previous token is back
    # (gpu_step/overlapped_steps.py): greedy, one choice, no logprobs, penalty, beams, DoLa/SLED or
    # prefill_only. While a step is in flight, its last token is a placeholder: -(row + 1).
    overlaps: bool = False
    # Structured output: its place in the request's grammar (grammar.py's SequenceGrammar).
    grammar: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens
