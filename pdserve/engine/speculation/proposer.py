"""Proposers of speculative decoding: who guesses the next tokens the target verifies.

The contract between the engine and a proposer (`Proposer`):

- `propose(seqs, k) -> list[list[int]]` is called once per step, before the step is scheduled,
  with the running decode sequences that may speculate (`SamplingParams.speculative`, no beam
  search, no DoLa/SLED, repetition_penalty == 1, not prefill_only). Each has every token but its
  last computed: `seq.num_computed_tokens == seq.num_tokens - 1` and no draft tokens appended
  (`seq.num_draft_tokens == 0`); `seq.token_ids` is the prompt + the output so far. It returns,
  per sequence in order, at most k tokens guessed to follow `seq.token_ids` (may be empty).
- `draft_probs() -> list[torch.Tensor | None]`: right after `propose`, per sequence of that call
  the distribution q each draft token was drawn from, a float32 tensor
  [len(proposal), vocab] (rows sum to 1; the filtering of temperature/top-k/top-p applied, as
  `sampler.filtered_probs` does), or None when the tokens were picked deterministically (q is
  then a point mass on each token, as for prompt lookup or a greedy draft). Verification uses q
  only for sampled (temperature > 0) requests.
- `copy_blocks(copies)`: the (source, destination) block copies the engine makes in the
  target's KV cache this step (fork copy-on-write), before the forward; a proposer that keeps
  KV under the target's block ids makes the same copies in its cache. No-op otherwise.
- `forget(seq)`: the sequence finished, was aborted or preempted (its blocks are released and
  a preempted one recomputes from scratch): drop what the proposer keeps for it.
- `writes_kv`: True for a proposer that writes KV under the target's block ids. The engine
  then grows each proposed-for sequence's block table to hold `seq.num_tokens + k - 1` tokens
  before calling `propose` (a sequence it cannot grow is not proposed for), so the positions
  the draft writes (the last token and the drafts but the last) have blocks. A block there may
  still be shared with another fork until the scheduler's copy-on-write: what the draft writes
  there can spoil only the other fork's draft KV, i.e. its acceptance, never its output.

After the step the first `seq.num_computed_tokens` tokens of `seq.token_ids` are what the target
computed and accepted; positions past them may hold the draft's KV of rejected tokens, so a
proposer that keeps KV records which tokens its KV holds and recomputes from the first that
differs. Acceptance never depends on the proposer being right: the target decides every token.

The proposers, one per module: `NgramProposer` (ngram_proposer.py, prompt lookup) and
`DraftProposer` (draft_model_proposer.py, imported only when used); `make_proposer` builds the
configured one.
"""

from __future__ import annotations

from typing import Any, Protocol

from pdserve.config import ConfigError
from pdserve.engine.sequence import Sequence
from pdserve.engine.speculation.ngram_proposer import NgramProposer
from pdserve.engine_config import EngineConfig, SpeculativeConfig


class Proposer(Protocol):
    """Guesses tokens for the target to verify (the contract is in the module docstring)."""

    writes_kv: bool

    def propose(self, seqs: list[Sequence], k: int) -> list[list[int]]: ...

    def draft_probs(self) -> list[Any | None]: ...

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None: ...

    def forget(self, seq: Sequence) -> None: ...


def make_proposer(config: EngineConfig, num_blocks: int) -> Proposer | None:
    """The proposer `config.speculative` names (None when off). `num_blocks`: the target's KV
    pool size, for a proposer that keeps KV under the target's block ids."""
    spec: SpeculativeConfig = config.speculative
    if spec.method == "ngram":
        return NgramProposer(spec.ngram_max, spec.ngram_min)
    if spec.method == "draft":
        try:
            from pdserve.engine.speculation.draft_model_proposer import DraftProposer
        except ImportError as e:
            raise ConfigError(
                "SpeculativeConfig", "method", f"the draft proposer is not available: {e}"
            ) from None
        return DraftProposer(config, num_blocks)
    return None
