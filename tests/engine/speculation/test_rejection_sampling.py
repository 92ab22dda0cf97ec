"""Rejection sampling through the engine: with every second token verified against a draft,
the pairs (first token, second token) a sampled request emits follow the target's own
distribution (transformers' logits, filtered as the Sampler filters them): chi-square over 20k
draws at a fixed prompt, p-value printed."""

from __future__ import annotations

import torch
from scipy.stats import chisquare

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.decoding.sampler import filtered_probs
from pdserve.engine.engine import LLMEngine
from pdserve.engine.speculation.ngram_proposer import NgramProposer
from pdserve.engine_config import EngineConfig, SpeculativeConfig

PROMPT = [17, 300, 42, 42, 9, 120]
PARAMS = SamplingParams(max_tokens=3, temperature=0.9, top_k=4, n=64, ignore_eos=True)
REQUESTS = 320  # x 64 choices = 20480 draws


def target_probs(hf, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = hf(torch.tensor([tokens])).logits[0, -1:].float()
    return filtered_probs(logits, [PARAMS])[0]


def test_pairs_follow_the_target_distribution(tiny_dir, hf_tiny):
    first = target_probs(hf_tiny, PROMPT)
    support = first.nonzero().squeeze(1).tolist()
    after = {t: target_probs(hf_tiny, PROMPT + [t]) for t in support}
    best = {t: int(p.argmax()) for t, p in after.items()}

    class Guess(NgramProposer):
        """Proposes the target's likeliest second token (accepted often, not always)."""

        def propose(self, seqs, k):
            self._num_proposed = len(seqs)
            return [[best[s.token_ids[-1]]] for s in seqs]

    config = EngineConfig(
        model=str(tiny_dir),
        block_size=4,
        num_kv_blocks=4096,
        max_num_seqs=1024,
        max_num_batched_tokens=4096,
        speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=1, min_acceptance=0),
    )
    engine = LLMEngine(config)
    engine._speculation.proposer = Guess()  # noqa: SLF001
    counts: dict[tuple[int, int], int] = {}
    for i in range(REQUESTS):
        engine.add_request(f"r{i}", PROMPT, PARAMS)
    tokens: dict[tuple[str, int], list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
    for run in tokens.values():
        counts[(run[0], run[1])] = counts.get((run[0], run[1]), 0) + 1
    stats = engine.stats()
    draws = len(tokens)
    assert draws == REQUESTS * PARAMS.n
    assert stats["spec_verify_steps"] == draws  # every second token went through verification
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    pairs = [(a, b) for a in support for b in after[a].nonzero().squeeze(1).tolist()]
    assert sum(counts.get(pair, 0) for pair in pairs) == draws  # nothing outside the filters
    expected = torch.tensor([float(first[a] * after[a][b]) for a, b in pairs], dtype=torch.float64)
    expected = expected / expected.sum() * draws
    observed = [counts.get(pair, 0) for pair in pairs]
    result = chisquare(observed, expected.numpy())
    rate = stats["spec_accepted_tokens"] / stats["spec_draft_tokens"]
    print(
        f"{draws} draws over {len(pairs)} pairs, acceptance {rate:.3f}, p-value {result.pvalue:.4f}"
    )
    assert result.pvalue > 1e-3
