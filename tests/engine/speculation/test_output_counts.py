"""Each RequestOutput carries its step's speculative decoding counts (what the decode worker's
span reports per request); they add up to the engine's spec_* stats, and a request that opts
out has none."""

from __future__ import annotations

from collections import defaultdict

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine_config import SpeculativeConfig

PERIODIC = [5, 17, 99, 23, 42, 7] * 4


def test_outputs_carry_the_draft_and_accepted_tokens_of_their_step(make_engine):
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, min_acceptance=0.0)
    engine = make_engine(speculative=spec)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    engine.add_request("spec", PERIODIC, params)
    engine.add_request(
        "plain", PERIODIC[:10], SamplingParams(**{**vars(params), "speculative": False})
    )
    drafted, accepted = defaultdict(int), defaultdict(int)
    while engine.has_unfinished():
        for out in engine.step():
            assert 0 <= out.num_accepted_tokens <= out.num_draft_tokens
            if out.num_draft_tokens:  # every accepted draft token is in the output, plus one
                assert len(out.new_token_ids) <= out.num_accepted_tokens + 1
            drafted[out.request_id] += out.num_draft_tokens
            accepted[out.request_id] += out.num_accepted_tokens
    stats = engine.stats()
    assert drafted["spec"] == stats["spec_draft_tokens"] > 0
    assert accepted["spec"] == stats["spec_accepted_tokens"] > 0
    assert drafted["plain"] == accepted["plain"] == 0
