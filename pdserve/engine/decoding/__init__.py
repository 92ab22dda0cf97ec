"""The decoding rules: how a step's logits become a request's tokens. Import from the modules
themselves.

- `sampler.py` — `Sampler`: repetition penalty, the min_tokens mask; greedy / temperature /
  top-k / top-p / min-p / seeded sampling (the seed contract), logprobs (torch).
- `seeded_noise.py` — the Gumbel noise of seeded draws, hashed from (seed, n, token id).
- `seeded_draw.py` — a seeded row's Gumbel-max draw: torch, or the fused CPU kernel
  (models/csrc/seeded_draw.cpp) drawing the same tokens.
- `grammar.py` — `Grammars`: structured output with xgrammar (compiled grammars cached per
  spec, a matcher per sequence; drafts cut where the grammar refuses them).
- `grammar_masks.py` — `GrammarMasks`: a step's token bitmasks, filled by a worker thread
  while the forward runs and applied before sampling (draft rows included).
- `beam_search.py` — `BeamSearch`: one beam-search request's state, transformers' rule;
  `BeamRequest`: its running beams and their offers (no torch).
- `forked_choices.py` — `ForkedChoices`: n choices and beam search as forked sequences sharing
  KV blocks (no torch).
- `factuality.py` — DoLa and SLED: contrast the final layer's logits with earlier layers'
  (torch).
- `premature_layers.py` — which earlier layers a DoLa/SLED request contrasts with (no torch).
"""
