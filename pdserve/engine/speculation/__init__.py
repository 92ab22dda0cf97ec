"""Speculative decoding: a proposer guesses the next tokens, the target verifies them in one
forward, and the engine keeps what the target accepts (docs/decoding.md, "Speculative
decoding"). Import from the modules themselves.

- `speculative_step.py` — `Speculation`, the engine's side of it each step: drafts into the
  batch and out of it, rollback of rejected ones, counters, the self switch-off (no torch).
- `proposer.py` — the `Proposer` contract between the engine and a proposer, and
  `make_proposer`, which builds the configured one.
- `ngram_proposer.py` — `NgramProposer`: prompt lookup, the longest suffix n-gram seen earlier
  (no torch).
- `draft_model_proposer.py` — `DraftProposer`: a draft model's proposals, its paged KV cache
  under the target's block ids (torch).
- `verification.py` — `verify`: which drafts the target accepts (greedy, the coupled draw of
  seeded requests, rejection sampling) and its own token after them (torch).
- `payoff.py` — `StepTimes`, `DraftAcceptance`, `best_length`: decode steps timed with and
  without drafts, whether speculation pays and how many tokens to propose (no torch).
"""
